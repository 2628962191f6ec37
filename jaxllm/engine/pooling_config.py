"""Which runner a model gets (vLLM's --runner / --convert) and its resolved PoolerConfig: the
user's settings first, then the model's sentence-transformers files, then the task's defaults."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from jaxllm.config import PoolerConfig
from jaxllm.models import ARCHITECTURES
from jaxllm.models.bert import ENCODER_ARCHITECTURES

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
_SEQ_CLS = "ForSequenceClassification"
# sentence-transformers' 1_Pooling/config.json flags -> vLLM's pooling types
_ST_POOLING = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
               "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


def architecture(hf_config: dict) -> str | None:
    return (hf_config.get("architectures") or [None])[0]


def decoder_base(arch: str | None) -> str | None:
    """The causal-LM architecture a decoder classifier is built on (Qwen3ForSequenceClassification
    -> Qwen3ForCausalLM), the architecture itself for a causal LM, else None."""
    if arch and arch.endswith(_SEQ_CLS):
        arch = arch[:-len(_SEQ_CLS)] + "ForCausalLM"
    return arch if arch in ARCHITECTURES else None


def resolve_runner(hf_config: dict, runner: str, convert: str) -> tuple[str, str]:
    """-> (generate | pooling, none | embed | classify). auto: pooling for encoders and
    *ForSequenceClassification models, generate for causal LMs (as vLLM)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}.")
    arch = architecture(hf_config)
    pooling_only = arch in ENCODER_ARCHITECTURES or bool(arch and arch.endswith(_SEQ_CLS))
    if runner == "auto":
        runner = "pooling" if pooling_only or convert in ("embed", "classify") else "generate"
    if runner == "generate":
        if pooling_only:
            raise ValueError(f"{arch} is a pooling model: it supports `--runner pooling` only.")
        if convert not in ("auto", "none"):
            raise ValueError(f"--convert {convert} needs `--runner pooling`.")
        return runner, "none"
    if arch not in ENCODER_ARCHITECTURES and decoder_base(arch) is None:
        raise ValueError(f"Model architecture {arch!r} is not supported as a pooling model.")
    if convert in ("auto", "none"):
        convert = "classify" if arch.endswith(_SEQ_CLS) else "embed"
    if convert == "classify" and arch in ENCODER_ARCHITECTURES and not arch.endswith(_SEQ_CLS):
        raise ValueError(f"{arch} has no classifier head: `--convert classify` needs a "
                         f"*ForSequenceClassification checkpoint.")
    return runner, convert


def _read_json(path: str) -> dict | list | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sentence_transformers_pooling(model_path: str) -> str | None:
    """The pooling type of a sentence-transformers model (modules.json's Pooling module), if any."""
    modules = _read_json(os.path.join(model_path, "modules.json")) or []
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("models.Dense"):
            raise ValueError("sentence-transformers Dense modules are not supported.")
        if not kind.endswith("models.Pooling"):
            continue
        config = _read_json(os.path.join(model_path, module.get("path", ""), "config.json")) or {}
        used = [name for name in _ST_UNSUPPORTED if config.get(name)]
        if used:
            raise ValueError(f"sentence-transformers pooling {used[0]} is not supported.")
        return next((kind for flag, kind in _ST_POOLING.items() if config.get(flag)), None)
    return None


def sentence_transformers_max_len(model_path: str) -> int | None:
    """max_seq_length of sentence_bert_config.json (the length the model was trained for)."""
    config = _read_json(os.path.join(model_path, "sentence_bert_config.json")) or {}
    return config.get("max_seq_length")


def resolve_pooler_config(model_path: str, hf_config: dict, convert: str,
                          override: PoolerConfig | None) -> PoolerConfig:
    """Every field set: the user's, else the model's, else the task's default (embed:
    normalised; classify: softmax; encoders pool CLS, decoders LAST, as vLLM)."""
    override = override or PoolerConfig()
    encoder = architecture(hf_config) in ENCODER_ARCHITECTURES
    if override.pooling_type is None:
        st_type = sentence_transformers_pooling(model_path) if os.path.isdir(model_path) else None
        override = replace(override, pooling_type=st_type or ("CLS" if encoder else "LAST"))
    if override.dimensions is not None and not is_matryoshka(hf_config):
        raise ValueError(_NOT_MATRYOSHKA.format(model=model_path))
    return replace(override,
                   normalize=convert == "embed" if override.normalize is None else override.normalize,
                   use_activation=True if override.use_activation is None
                   else override.use_activation)


_NOT_MATRYOSHKA = ('Model "{model}" does not support matryoshka representation, changing output '
                   'dimensions will lead to poor results.')


def is_matryoshka(hf_config: dict) -> bool:
    return bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))


def check_dimensions(dimensions: int, hf_config: dict, model: str, hidden_size: int) -> None:
    """vLLM's checks of a request's (or the config's) Matryoshka `dimensions`."""
    if not is_matryoshka(hf_config):
        raise ValueError(_NOT_MATRYOSHKA.format(model=model))
    allowed = hf_config.get("matryoshka_dimensions")
    if allowed and dimensions not in allowed:
        raise ValueError(f'Model "{model}" only supports {allowed} matryoshka dimensions, use '
                         f'other output dimensions will lead to poor results.')
    if not 1 <= dimensions <= hidden_size:
        raise ValueError(f"dimensions must be in [1, {hidden_size}], got {dimensions}.")


def pooling_max_model_len(model_path: str, hf_config: dict) -> int:
    """The default max_model_len of a pooling model: its position table (RoBERTa's less its
    offset), capped by sentence-transformers' max_seq_length as vLLM does."""
    limit = hf_config.get("max_position_embeddings", 2048)
    if ENCODER_ARCHITECTURES.get(architecture(hf_config)) == "roberta":
        limit -= hf_config.get("pad_token_id", 1) + 1
    st_len = sentence_transformers_max_len(model_path) if os.path.isdir(model_path) else None
    return min(limit, st_len) if st_len else limit
