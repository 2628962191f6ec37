"""Loading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a base model.

The weights file is the truth about what the adapter touches (`target_modules` may be a list, a
regex or "all-linear"); the config supplies the scaling. Each module's (A, B) comes back in
jaxllm's [in, out] layout, A [in, r] and B [r, out] in float32, the scaling folded into B, so
that the adapted projection is x @ W + (x @ A) @ B.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, which safetensors' reader needs
import numpy as np
from safetensors.numpy import load_file

from jaxllm.models.args import ModelArgs
from jaxllm.models.lora import module_shapes

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# BERT-family encoders: the module path under a layer -> jaxllm's target name (models/lora.py)
ENCODER_TARGETS = {"attention.self.query": "query", "attention.self.key": "key",
                   "attention.self.value": "value", "attention.output.dense": "attn_out",
                   "intermediate.dense": "intermediate", "output.dense": "output"}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Config fields that change what the adapter computes and that jaxllm does not implement: refused
# when set (not None, False, "none", empty).
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora) is not supported",
    "modules_to_save": "modules_to_save (fully trained copies of base modules) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-layout weights) is not supported",
    "lora_bias": "lora_bias (a bias on lora_B) is not supported",
    "layer_replication": "layer_replication (a model with repeated layers) is not supported",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows) is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts) is not "
                         "supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
}
# Fields that do not change inference with a plain LoRA: bookkeeping, training-only settings,
# initialisation recipes whose result is the saved weights, and those read here (r, lora_alpha,
# use_rslora, rank_pattern, alpha_pattern, bias, init_lora_weights, peft_type).
_KNOWN_FIELDS = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "r", "lora_alpha", "use_rslora", "rank_pattern",
    "alpha_pattern", "bias", "init_lora_weights", "target_modules", "exclude_modules",
    "lora_dropout", "layers_to_transform", "layers_pattern", "megatron_config", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "runtime_config",
    "qalora_group_size", "ensure_weight_tying",
}
# init_lora_weights recipes that also rewrite the base weights (a residual model saved beside the
# adapter): applied to the original base model such an adapter is wrong.
_RESIDUAL_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
_KEY = re.compile(r"^(?P<module>.+)\.(?P<half>lora_A|lora_B)(?:\.default)?\.weight$")
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<target>\w+)$")
# encoder.layer.{i}.{path} of BertModel, or under bert. / roberta. in the *For* classes
_ENCODER_MODULE = re.compile(r"^(?:\w+\.)?encoder\.layer\.(?P<layer>\d+)\.(?P<target>[\w.]+)$")


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    name: str
    rank: int  # the largest r over the adapter's modules
    # per layer: target module name -> (A [in, r], B [r, out] with the scaling folded in), float32
    layers: tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.layers for a, b in layer.values())


def load_peft_adapter(path: str, args, *, max_lora_rank: int, name: str = "") -> LoRAAdapter:
    """Reads and validates the PEFT LoRA adapter in directory `path` against the base model
    `args` (a decoder's ModelArgs or an encoder's BertArgs). Raises ValueError naming the adapter path and the problem for: a missing directory,
    adapter_config.json or adapter_model.safetensors (adapter_model.bin is refused: convert it
    to safetensors); peft_type other than LORA; any field of `_REFUSED_FIELDS` set (DoRA,
    modules_to_save, fan_in_fan_out, lora_bias, layer_replication, trainable_token_indices,
    target_parameters, aLoRA, QA-LoRA, BD-LoRA, Arrow, KaSA, MonteCLoRA, VeLoRA); bias other
    than "none"; an init_lora_weights that rewrites the base weights (PiSSA, CorDA, OLoRA,
    LoftQ, LoRA-GA); any config field jaxllm does not know that is set; a tensor that is not a
    lora_A/lora_B weight of q/k/v/o_proj or a dense gate/up/down_proj (an encoder's query, key,
    value, attention output, intermediate and output dense layers) (embed_tokens, lm_head, MoE
    experts and routers, a BERT pooler, DoRA magnitudes, biases); a layer index beyond the model; a module with
    only one of A and B; a rank above `max_lora_rank`; an A or B whose shape does not match the
    base model and the configured rank."""
    config = _read_config(path)
    _check_config(config, path)
    tensors = _read_weights(path)
    layers = [{} for _ in range(args.num_layers)]
    ranks = []
    for module_key, (a, b) in _pair_halves(tensors, path).items():
        layer, target = _locate(module_key, args, path)
        r, alpha = _rank_and_alpha(config, module_key)
        if r > max_lora_rank:
            raise ValueError(f"LoRA rank {r} is greater than max_lora_rank {max_lora_rank} "
                             f"(adapter {path}, {module_key}).")
        _check_shapes(a, b, r, module_shapes(args)[target], f"{target} of layer {layer}", path)
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        layers[layer][target] = (_frozen(a.T), _frozen(b.T, scale))
        ranks.append(r)
    if not ranks:
        raise ValueError(f"LoRA adapter {path} has no lora_A/lora_B weights.")
    return LoRAAdapter(name=name or os.path.basename(os.path.normpath(path)), rank=max(ranks),
                       layers=tuple(layers))


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"No LoRA adapter found at {path}: not a directory.")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path} has no {CONFIG_FILE}.")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} is not valid JSON ({e}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path}: {CONFIG_FILE} is not a JSON object.")
    return config


def _is_set(value) -> bool:
    return value not in (None, False, "none", "", [], {}, 0)


def _check_config(config: dict, path: str) -> None:
    def refuse(problem: str):
        raise ValueError(f"LoRA adapter {path}: {problem}.")

    if config.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {config['peft_type']!r} is not supported (only LORA)")
    for field, problem in _REFUSED_FIELDS.items():
        if _is_set(config.get(field)):
            refuse(f"{problem} ({field}={config[field]!r})")
    if config.get("bias", "none") != "none":
        refuse(f"bias={config['bias']!r} is not supported (only 'none')")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(_RESIDUAL_INITS):
        refuse(f"init_lora_weights={config['init_lora_weights']!r} adapters need the residual "
               "base model saved with them; convert the adapter to a plain LoRA (PEFT's "
               "save_pretrained(path_initial_model_for_weight_conversion=...))")
    unknown = sorted(k for k in config if k not in _KNOWN_FIELDS and k not in _REFUSED_FIELDS
                     and _is_set(config[k]))
    if unknown:
        refuse(f"config fields {unknown} are not known to jaxllm (refused rather than ignored)")
    for field in ("r", "lora_alpha"):
        if not isinstance(config.get(field), (int, float)) or config[field] <= 0:
            refuse(f"{field} must be a positive number, got {config.get(field)!r}")


def _read_weights(path: str) -> dict[str, np.ndarray]:
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise ValueError(f"LoRA adapter {path}: adapter_model.bin (a pickle) is not "
                             f"supported; save the adapter as {WEIGHTS_FILE}.")
        raise ValueError(f"LoRA adapter {path} has no {WEIGHTS_FILE}.")
    return load_file(weights)


def _pair_halves(tensors: dict[str, np.ndarray], path: str) -> dict[str, tuple]:
    """{module key without PEFT's `base_model.model.` prefix: (lora_A [r, in], lora_B [out, r])}."""
    unsupported = sorted(key for key in tensors if _KEY.match(key) is None)
    if unsupported:
        raise ValueError(f"LoRA adapter {path}: tensors {unsupported} are not supported: jaxllm "
                         f"applies LoRA A/B weights to {', '.join(LORA_TARGETS)} only.")
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.match(key)
        module = match["module"].removeprefix("base_model.model.")
        halves.setdefault(module, {})[match["half"]] = value
    for module, pair in halves.items():
        if len(pair) != 2:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {path}: {module} has no {missing} weight.")
    return {module: (pair["lora_A"], pair["lora_B"]) for module, pair in halves.items()}


def _locate(module_key: str, args, path: str) -> tuple[int, str]:
    """model.layers.{i}.self_attn.q_proj -> (i, "q_proj") (an encoder's
    encoder.layer.{i}.attention.self.query -> (i, "query")); anything jaxllm cannot apply
    raises."""
    if not isinstance(args, ModelArgs):
        return _locate_in_encoder(module_key, args, path)
    match = _MODULE.match(module_key)
    if match is None or _PARENT.get(match["target"]) != match["parent"]:
        what = "MoE experts are" if ".experts." in module_key else f"{module_key} is"
        raise ValueError(f"LoRA adapter {path}: target module {module_key} is not supported: "
                         f"{what} not among the modules jaxllm applies LoRA to "
                         f"({', '.join(LORA_TARGETS)} of the decoder layers).")
    layer, target = _layer_index(match, module_key, args, path), match["target"]
    if match["parent"] == "mlp" and args.layer_mlp_kind(layer) != "dense":
        raise ValueError(f"LoRA adapter {path}: target module {module_key} is not supported: "
                         f"layer {layer}'s MLP is a mixture of experts.")
    return layer, target


def _locate_in_encoder(module_key: str, args, path: str) -> tuple[int, str]:
    match = _ENCODER_MODULE.match(module_key)
    if match is None or match["target"] not in ENCODER_TARGETS:
        raise ValueError(f"LoRA adapter {path}: target module {module_key} is not supported: "
                         f"not among the modules jaxllm applies LoRA to in an encoder "
                         f"({', '.join(ENCODER_TARGETS)} of the encoder layers).")
    return _layer_index(match, module_key, args, path), ENCODER_TARGETS[match["target"]]


def _layer_index(match: re.Match, module_key: str, args, path: str) -> int:
    layer = int(match["layer"])
    if layer >= args.num_layers:
        raise ValueError(f"LoRA adapter {path}: {module_key} is beyond the base model, which has "
                         f"{args.num_layers} layers.")
    return layer


def _rank_and_alpha(config: dict, module_key: str) -> tuple[int, float]:
    """PEFT's per-module r and lora_alpha: the first rank_pattern / alpha_pattern key that matches
    the end of the module's name (a regex), else the global value."""
    def lookup(patterns: dict, default):
        for pattern, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", module_key):
                return value
        return default

    return (int(lookup(config.get("rank_pattern"), config["r"])),
            float(lookup(config.get("alpha_pattern"), config["lora_alpha"])))


def _check_shapes(a: np.ndarray, b: np.ndarray, r: int, in_out: tuple[int, int], where: str,
                  path: str) -> None:
    fan_in, fan_out = in_out
    for half, got, expected in (("lora_A", a.shape, (r, fan_in)),
                                ("lora_B", b.shape, (fan_out, r))):
        if tuple(got) != expected:
            raise ValueError(f"LoRA adapter {path}: {half} of {where} has shape {tuple(got)}, "
                             f"expected {expected} (rank {r}).")


def _frozen(x: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """A read-only contiguous float32 copy of `scale * x` (cached adapters are shared between
    requests); the product is taken in float32 whatever the stored dtype."""
    out = np.ascontiguousarray(np.asarray(x, np.float32) * np.float32(scale))
    out.setflags(write=False)
    return out
