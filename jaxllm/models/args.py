"""ModelArgs: the static shape and feature flags of a decoder, read from an HF config dict.

The HF `architectures` field picks a reader from `ARCHITECTURES`; every supported family is the
same pre-norm decoder with a few switches (qkv bias, q/k norm, rope scaling, MLP kind).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position: int = 8192  # llama3 only
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    sliding_window: int | None = None
    mlp_kind: str = "dense"  # key into models.layers.MLPS; MoE slots in here
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that use the dense MLP
    # The checkpoint holds static per-layer K and V scales for an FP8 KV cache (a
    # compressed-tensors kv_cache_scheme, ModelOpt's kv_cache_quant_algo FP8): params' layers
    # then carry k_scale and v_scale.
    kv_cache_scales: bool = False

    def layer_mlp_kind(self, layer_index: int) -> str:
        return "dense" if layer_index in self.dense_layers else self.mlp_kind

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            raise ValueError(f"Model architecture {arch!r} is not supported. Supported "
                             f"architectures: {sorted(ARCHITECTURES)}.")
        return ARCHITECTURES[arch](cfg, arch)


def _rope_fields(cfg: dict) -> dict:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` and
    # `rope_scaling`.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {_ROPE_TYPES}.")
    fields = dict(rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
                  rope_type=rope_type, rope_factor=float(rope.get("factor", 1.0)))
    if rope_type == "llama3":
        fields.update(rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_position=int(rope["original_max_position_embeddings"]))
    return fields


def _dense_args(cfg: dict, arch: str, **overrides) -> ModelArgs:
    if cfg.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=True is not supported.")
    num_heads = cfg["num_attention_heads"]
    fields = dict(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)), o_bias=bool(cfg.get("attention_bias", False)),
        sliding_window=cfg.get("sliding_window"), **_rope_fields(cfg),
        kv_cache_scales=_kv_cache_scales(cfg.get("quantization_config") or {}))
    fields.update(overrides)
    return ModelArgs(**fields)


def _llama(cfg: dict, arch: str) -> ModelArgs:
    return _dense_args(cfg, arch, sliding_window=None)


def _mistral(cfg: dict, arch: str) -> ModelArgs:
    return _dense_args(cfg, arch)


def _qwen_window(cfg: dict) -> int | None:
    return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None


def _qwen2(cfg: dict, arch: str) -> ModelArgs:
    # Qwen2 always has q/k/v biases and no o_proj bias, whatever attention_bias says.
    return _dense_args(cfg, arch, qkv_bias=True, o_bias=False, sliding_window=_qwen_window(cfg))


def _qwen3(cfg: dict, arch: str) -> ModelArgs:
    return _dense_args(cfg, arch, qk_norm=True, sliding_window=_qwen_window(cfg))


def _mixtral(cfg: dict, arch: str) -> ModelArgs:
    return _dense_args(cfg, arch, mlp_kind="moe", num_experts=cfg["num_local_experts"],
                       num_experts_per_tok=cfg["num_experts_per_tok"],
                       moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)


def _qwen_moe_fields(cfg: dict) -> dict:
    num_layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
    only_mlp = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
    num_experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 name
    return dict(mlp_kind="moe", num_experts=num_experts,
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense,
                sliding_window=_qwen_window(cfg))


def _qwen3_moe(cfg: dict, arch: str) -> ModelArgs:
    return _dense_args(cfg, arch, qk_norm=True, **_qwen_moe_fields(cfg))


def _qwen2_moe(cfg: dict, arch: str) -> ModelArgs:
    return _dense_args(cfg, arch, qkv_bias=True, o_bias=False, **_qwen_moe_fields(cfg),
                       shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0))


ARCHITECTURES: dict[str, Callable[[dict, str], ModelArgs]] = {
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _mistral,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MixtralForCausalLM": _mixtral,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Qwen2MoeForCausalLM": _qwen2_moe,
}


def _kv_cache_scales(qconfig: dict) -> bool:
    """Whether a quantization_config says the checkpoint holds static KV cache scales."""
    return bool(qconfig.get("kv_cache_scheme")) or str(
        qconfig.get("kv_cache_quant_algo") or "").upper() == "FP8"
