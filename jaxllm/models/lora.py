"""LoRA adapters inside the step: every layer's adapters stacked in slots, each token reading its
own slot's (Punica's batched LoRA), so one step mixes the base model and several adapters.

A slot holds, per layer and projection group, A [in, r] and B [r, out] at the engine's
max_lora_rank (smaller ranks zero-padded; the adapter's scaling folded into B). Slot 0 stays
zero: tokens of base-model requests add nothing. The groups follow the fused compute layout
(models/fused.py): q/k/v share one A [H, 3r] (their three A's side by side) and one B
[3r, Hkv * (G + 2) * D] that is block-diagonal, with its columns in wqkv's head order, so the
update adds straight onto the fused projection's output; gate/up likewise onto w_gate_up's.
A model family's targets and groups are its `LoRALayout` (decoders: HF's q/k/v/o/gate/up/down
projections; BERT-family encoders: query/key/value, the attention output, intermediate and
output dense layers; encoders keep q, k and v apart, so their q/k/v group's B keeps HF's column
order: all of q, then k, then v).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.args import ModelArgs
from pallas_kernels import lora as lora_kernels

# projection group -> the HF modules (PEFT's target names) it fuses, in output order
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
          "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
ENCODER_GROUPS = {"qkv": ("query", "key", "value"), "o": ("attn_out",), "in": ("intermediate",),
                  "out": ("output",)}


@dataclass(frozen=True)
class LoRALayout:
    """Where a model family's adapters go."""
    shapes: dict[str, tuple[int, int]]  # target -> (in, out): HF's Linear(in, out)
    groups: dict[str, tuple[str, ...]]  # group -> its targets in output order, every layer
    # (q size, kv size, kv heads, head dim) of a fused wqkv's q/k/v group; None: HF's order
    heads: tuple[int, int, int, int] | None


def layout_of(args) -> LoRALayout:
    """A decoder's (ModelArgs) or a BERT-family encoder's (models/bert.py's BertArgs) layout."""
    if isinstance(args, ModelArgs):
        h, q, kv, i = args.hidden_size, args.q_size, args.kv_size, args.intermediate_size
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        # the MLP's groups only in a dense model (experts take no adapters)
        groups = {g: m for g, m in GROUPS.items()
                  if args.mlp_kind == "dense" or g in ("qkv", "o")}
        return LoRALayout(shapes, groups, (q, kv, args.num_kv_heads, args.head_dim))
    h, i = args.hidden_size, args.intermediate_size
    shapes = {"query": (h, h), "key": (h, h), "value": (h, h), "attn_out": (h, h),
              "intermediate": (h, i), "output": (i, h)}
    return LoRALayout(shapes, ENCODER_GROUPS, None)


def module_shapes(args) -> dict[str, tuple[int, int]]:
    """Each target's (in, out): HF's Linear(in, out), i.e. jaxllm's stored [in, out] weight."""
    return layout_of(args).shapes


def slot_shapes(args, rank: int) -> dict[str, tuple[int, int]]:
    """One slot's arrays in a layer: {group}_a [in, len(modules) * r], {group}_b [..., out]."""
    layout = layout_of(args)
    out = {}
    for group, modules in layout.groups.items():
        fan_in = layout.shapes[modules[0]][0]
        fan_out = sum(layout.shapes[m][1] for m in modules)
        out[f"{group}_a"] = (fan_in, len(modules) * rank)
        out[f"{group}_b"] = (len(modules) * rank, fan_out)
    return out


def init_stacks(args, num_slots: int, rank: int, dtype) -> list[dict]:
    """Every layer's slots, all zero: [num_slots, *slot shape] per array."""
    shapes = slot_shapes(args, rank)
    return [{name: jnp.zeros((num_slots, *shape), dtype) for name, shape in shapes.items()}
            for _ in range(args.num_layers)]


def pack_slot(adapter_layers, args, rank: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """An adapter's per-layer {module: (A [in, r], B [r, out])} as one slot's arrays in the
    layout init_stacks holds, every layer's stacked: {name: [L, *slot shape]}, in `dtype` (the
    stacks': half the bytes to move for 16 bits). One array per name, so that moving a slot in
    is a few large transfers."""
    layout = layout_of(args)
    packed = {name: np.zeros((len(adapter_layers), *shape), dtype)
              for name, shape in slot_shapes(args, rank).items()}
    for layer, modules in enumerate(adapter_layers):
        for group, targets in layout.groups.items():
            a, b = packed[f"{group}_a"][layer], packed[f"{group}_b"][layer]
            column = 0
            for k, module in enumerate(targets):
                width = layout.shapes[module][1]
                if module in modules:
                    lora_a, lora_b = modules[module]
                    r = lora_a.shape[1]
                    a[:, k * rank:k * rank + r] = lora_a
                    b[k * rank:k * rank + r, column:column + width] = lora_b
                column += width
            if group == "qkv" and layout.heads is not None:
                b[:] = _to_fused_heads(b, *layout.heads)
    return packed


def _to_fused_heads(b: np.ndarray, q: int, kv: int, num_kv: int, d: int) -> np.ndarray:
    """B's columns from HF's order (all q heads, then k, then v) to wqkv's: KV head j's G query
    heads, then its k, then its v."""
    rows = b.shape[0]
    parts = [b[:, :q].reshape(rows, num_kv, -1, d), b[:, q:q + kv].reshape(rows, num_kv, 1, d),
             b[:, q + kv:].reshape(rows, num_kv, 1, d)]
    return np.concatenate(parts, axis=2).reshape(rows, -1)


@partial(jax.jit, donate_argnums=0)
def write_slot(stacks: list[dict], slot: jax.Array, arrays: dict) -> list[dict]:
    """stacks with slot `slot` replaced by arrays ({name: [L, ...]}, pack_slot's; in place: the
    stacks are donated). The slot is a traced index, so every slot shares one program."""
    return [{name: stack.at[slot].set(arrays[name][layer].astype(stack.dtype))
             for name, stack in layer_stacks.items()}
            for layer, layer_stacks in enumerate(stacks)]


def _lora_add():
    """The Pallas kernels on a GPU; elsewhere their reference (interpret mode is slow)."""
    if jax.default_backend() == "gpu":
        return lora_kernels.lora_add
    return lora_kernels.lora_add_reference


@dataclass(frozen=True)
class TokenLoRA:
    """One layer's adapter stacks and each token's slot, inside a traced step."""
    stacks: dict  # {group}_a [S, in, n*r], {group}_b [S, n*r, out]
    slot_ids: jax.Array  # [T] int32

    def add(self, base: jax.Array, x: jax.Array, group: str) -> jax.Array:
        """base [T, ..., out] (the projection of x) + x @ A[slot] @ B[slot] per token."""
        if f"{group}_a" not in self.stacks:
            return base
        flat = base.reshape(base.shape[0], -1)
        return _lora_add()(flat, x, self.stacks[f"{group}_a"], self.stacks[f"{group}_b"],
                           self.slot_ids).reshape(base.shape)
