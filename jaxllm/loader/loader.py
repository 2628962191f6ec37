"""load_model: an HF directory (or a dummy preset) -> ModelArgs, params on device, tokenizer."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxllm.loader.dummy import dummy_params
from jaxllm.loader.hf_names import flatten_paths, map_hf_name, split_expert_path, unflatten_paths
from jaxllm.loader.orbax_ckpt import is_orbax_checkpoint, restore_params
from jaxllm.loader.placement import Shardings, place
from jaxllm.loader.quant_checkpoint import QuantizedLinears, stack_fp8_experts
from jaxllm.loader.safetensors_io import count_tensors, iter_tensors, safetensors_files
from jaxllm.models import ModelArgs, param_shapes
from jaxllm.models.presets import PRESETS
from jaxllm.models.quant import shard_weight

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
_LOAD_FORMATS = ("auto", "dummy")


@dataclass
class LoadedModel:
    args: ModelArgs
    params: dict
    hf_config: dict
    tokenizer: object | None  # transformers PreTrainedTokenizerFast; None for dummy presets
    eos_token_ids: set[int]
    model_path: str  # the directory, or the preset name
    max_model_len: int  # default from the config (max_position_embeddings)
    dtype: jnp.dtype = field(default=jnp.float32)


def resolve_dtype(dtype: str) -> jnp.dtype:
    """'auto' is bfloat16 on GPU and float32 elsewhere."""
    if dtype == "auto":
        return jnp.dtype(jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {('auto', *_DTYPES)}, got {dtype!r}.")
    return jnp.dtype(_DTYPES[dtype])


def resolve_model_path(model: str | None, load_format: str = "auto") -> str:
    """The directory (or dummy preset name) `model` loads from: None is the default model and a
    .gguf file its converted HF directory (both made once into the cache)."""
    if load_format not in _LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {load_format!r}.")
    if model is None:
        from jaxllm.loader.default_model import default_model_dir
        return default_model_dir()
    if model.endswith(".gguf") and os.path.isfile(model):
        from jaxllm.loader.default_model import converted_gguf_dir
        return converted_gguf_dir(model)
    if load_format == "dummy" and model in PRESETS:
        return model
    if not os.path.isdir(model):
        raise ValueError(f"Model path {model!r} does not exist (or is not a directory). Pass a "
                         f"local HF model directory, a .gguf file, or with load_format='dummy' "
                         f"one of the presets {sorted(PRESETS)}.")
    return model


def read_hf_config(model_path: str, load_format: str = "auto") -> dict:
    """The HF config of a resolved model path (a preset's, with load_format='dummy'); a ModelOpt
    checkpoint's hf_quant_config.json becomes its quantization_config where config.json has
    none (as vLLM reads it)."""
    if load_format == "dummy" and model_path in PRESETS:
        return PRESETS[model_path]
    config = _read_json(os.path.join(model_path, "config.json"), required=True)
    modelopt = _read_json(os.path.join(model_path, "hf_quant_config.json"), required=False)
    if "quantization_config" not in config and isinstance(modelopt.get("quantization"), dict):
        config["quantization_config"] = {"quant_method": "modelopt", **modelopt["quantization"]}
    return config


def load_model(model: str | None, dtype: str = "auto", load_format: str = "auto", seed: int = 0,
               shardings: Shardings | None = None, tokenizer: str | None = None,
               quantization: str | None = None) -> LoadedModel:
    """model: a local HF directory, an Orbax checkpoint directory (`jaxllm convert`), a
    Llama-architecture .gguf file (converted once into the cache), a preset name (dummy only), or
    None for the default model. quantization: the checkpoint's method (ModelConfig's), whose
    quantised linears load packed."""
    model = resolve_model_path(model, load_format)
    target = resolve_dtype(dtype)
    if load_format == "dummy" and model in PRESETS:
        return _dummy_preset(model, target, seed, shardings)
    hf_config = read_hf_config(model)
    args = ModelArgs.from_hf_config(hf_config)
    if load_format == "dummy":
        params = dummy_params(args, target, seed, shardings)
    elif is_orbax_checkpoint(model):  # written by `jaxllm convert`: each device reads its shard
        params = restore_params(model, args, shardings, target)
    else:
        params = load_safetensors(model, args, target, shardings,
                                  quantized=QuantizedLinears(quantization, hf_config, target))
    tok = load_tokenizer(tokenizer or model)
    return LoadedModel(args=args, params=params, hf_config=hf_config, tokenizer=tok,
                       eos_token_ids=eos_token_ids(model, hf_config, tok), model_path=model,
                       max_model_len=hf_config.get("max_position_embeddings", 2048), dtype=target)


def _dummy_preset(name: str, dtype, seed: int, shardings) -> LoadedModel:
    hf_config = PRESETS[name]
    args = ModelArgs.from_hf_config(hf_config)
    return LoadedModel(args=args, params=dummy_params(args, dtype, seed, shardings),
                       hf_config=hf_config, tokenizer=None,
                       eos_token_ids=_as_id_set(hf_config.get("eos_token_id")), model_path=name,
                       max_model_len=hf_config["max_position_embeddings"], dtype=dtype)


# Output heads a checkpoint may hold that the model run from it need not use: the LM head of a
# tied model or of a decoder run as an embedder, a classifier's `score` run as a generator.
_HEADS = frozenset({"lm_head", "score"})


def load_safetensors(model_dir: str, args: ModelArgs, dtype, shardings: Shardings | None = None,
                     shapes: dict | None = None,
                     quantized: QuantizedLinears | None = None) -> dict:
    """Every tensor read memory-mapped, converted and placed on device one at a time; the
    tensors of quantised linears go to `quantized`, which builds their weights at the end.
    shapes: the params pytree to fill (default param_shapes(args)); heads outside it are
    skipped."""
    expected = flatten_paths(shapes or param_shapes(args))
    files = safetensors_files(model_dir)
    flat, experts = {}, {}
    with tqdm(total=count_tensors(files), desc="Loading weights", unit="tensor",
              disable=None) as progress:
        for path in files:
            for name, host in iter_tensors(path):
                progress.update()
                if quantized is not None and quantized.take(name, host):
                    continue
                mapped = map_hf_name(name)
                if mapped is None or (mapped[0] in _HEADS and mapped[0] not in expected):
                    continue
                param, transpose = mapped
                param, expert = split_expert_path(param)
                if expert is not None:  # stacked after the loop, once all experts are read
                    experts.setdefault(param, {})[expert] = host.T if transpose else host
                    continue
                if expected.get(param) == () and host.size == 1:  # a scalar, stored as [1]
                    host = host.reshape(())
                shape = tuple(reversed(host.shape)) if transpose else tuple(host.shape)
                if expected.get(param) != shape:
                    raise ValueError(f"Weight {name} has shape {host.shape}; the config expects "
                                     f"{expected.get(param)} for {param}.")
                flat[param] = place(host, dtype, transpose, shardings(param) if shardings else None)
    sharding_of_name = lambda name: shardings(map_hf_name(name)[0]) if shardings else None
    quantized_experts = {}
    for name, weight in quantized.weights(sharding_of_name) if quantized is not None else ():
        param, expert = split_expert_path(map_hf_name(name)[0])
        if expert is not None:  # host arrays, stacked below
            quantized_experts.setdefault(param, {})[expert] = weight
            continue
        if expected.get(param) != weight.shape:
            raise ValueError(f"Quantised weight {name} stands for a {weight.shape} matrix; the "
                             f"config expects {expected.get(param)} for {param}.")
        flat[param] = weight
    for param, by_index in experts.items():
        stacked = np.stack([by_index[j] for j in sorted(by_index)])  # [E, in, out]
        if expected.get(param) != stacked.shape:
            raise ValueError(f"Experts of {param} stack to {stacked.shape}; the config expects "
                             f"{expected.get(param)}.")
        flat[param] = place(stacked, dtype, False, shardings(param) if shardings else None)
    for param, by_index in quantized_experts.items():
        stacked = stack_fp8_experts([by_index[j] for j in sorted(by_index)])
        if expected.get(param) != stacked.shape:
            raise ValueError(f"Quantised experts of {param} stack to {stacked.shape}; the "
                             f"config expects {expected.get(param)}.")
        flat[param] = shard_weight(stacked, shardings(param) if shardings else None)
    missing = sorted(set(expected) - set(flat))
    if missing:
        raise ValueError(f"Checkpoint {model_dir} lacks weights: {missing[:8]}.")
    return unflatten_paths(flat, args.num_layers)


def load_tokenizer(path: str):
    """transformers' fast tokenizer from a directory; None when it has no tokenizer files."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        logger.warning("No tokenizer files in %s; running without a tokenizer.", path)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(model_dir: str, hf_config: dict, tokenizer) -> set[int]:
    """EOS ids from config.json and generation_config.json; the tokenizer's if both are silent."""
    generation = _read_json(os.path.join(model_dir, "generation_config.json"), required=False)
    ids = _as_id_set(hf_config.get("eos_token_id")) | _as_id_set(generation.get("eos_token_id"))
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = {tokenizer.eos_token_id}
    return ids


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def _read_json(path: str, required: bool) -> dict:
    if not os.path.exists(path):
        if required:
            raise ValueError(f"{path} does not exist: a model directory needs an HF config.json.")
        return {}
    with open(path) as f:
        return json.load(f)
