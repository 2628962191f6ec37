"""HF checkpoint tensor names -> paths in our params pytree.

A path is a dotted string: "embed", "final_norm", "lm_head", "layers.<i>.<name>". HF stores
linear weights as [out, in]; ours are [in, out], so those are marked for transposition.
"""

from __future__ import annotations

import re

# HF per-layer suffix -> (our name, transpose)
_LAYER = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "self_attn.k_scale": ("k_scale", False),  # an FP8 KV cache's static scales
    "self_attn.v_scale": ("v_scale", False),
    "self_attn.k_proj.k_scale": ("k_scale", False),  # ModelOpt's names for them
    "self_attn.v_proj.v_scale": ("v_scale", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
# MoE blocks: Mixtral's block_sparse_moe.*, Qwen2/3-MoE's mlp.*. Experts are stored one tensor per
# expert; their paths carry the expert index ("layers.<i>.experts_gate.<j>") and the loader
# stacks them into [E, ...] params.
_LAYER.update({
    "block_sparse_moe.gate.weight": ("router", True),
    "mlp.gate.weight": ("router", True),
    "mlp.shared_expert.gate_proj.weight": ("shared_gate", True),
    "mlp.shared_expert.up_proj.weight": ("shared_up", True),
    "mlp.shared_expert.down_proj.weight": ("shared_down", True),
    "mlp.shared_expert_gate.weight": ("shared_expert_gate", True),
})
_EXPERT_RE = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PROJ = {"w1": "experts_gate", "w3": "experts_up", "w2": "experts_down",
                "gate_proj": "experts_gate", "up_proj": "experts_up", "down_proj": "experts_down"}
_TOP = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
    "score.weight": ("score", True),  # *ForSequenceClassification's classifier
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def map_hf_name(name: str) -> tuple[str, bool] | None:
    """-> (param path, transpose), or None for tensors we do not use (rotary caches)."""
    if name in _TOP:
        return _TOP[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER:
        ours, transpose = _LAYER[match.group(2)]
        return f"layers.{match.group(1)}.{ours}", transpose
    expert = _EXPERT_RE.fullmatch(match.group(2)) if match else None
    if expert and expert.group(2) in _EXPERT_PROJ:
        return f"layers.{match.group(1)}.{_EXPERT_PROJ[expert.group(2)]}.{expert.group(1)}", True
    if _IGNORED.fullmatch(name):
        return None
    raise ValueError(f"Unexpected weight {name!r} in the checkpoint.")


def split_expert_path(path: str) -> tuple[str, int | None]:
    """"layers.0.experts_gate.3" -> ("layers.0.experts_gate", 3); other paths -> (path, None)."""
    parts = path.split(".")
    if len(parts) == 4:
        return ".".join(parts[:3]), int(parts[3])
    return path, None


def flatten_paths(tree: dict) -> dict[str, object]:
    """{"layers": [{"wq": x}]} -> {"layers.0.wq": x}."""
    flat = {}
    for key, value in tree.items():
        if key == "layers":
            for i, layer in enumerate(value):
                flat.update({f"layers.{i}.{k}": v for k, v in layer.items()})
        else:
            flat[key] = value
    return flat


def unflatten_paths(flat: dict[str, object], num_layers: int) -> dict:
    tree: dict = {"layers": [{} for _ in range(num_layers)]}
    for path, value in flat.items():
        parts = path.split(".")
        if parts[0] == "layers":
            tree["layers"][int(parts[1])][parts[2]] = value
        else:
            tree[path] = value
    return tree
