"""The weights' compute layout: each layer's q/k/v projections as one matrix and the dense MLP's
gate/up pair as one, so a step runs one GEMM for each group instead of three and two (at batch 1
a decode step is ~500 small kernels, each a few microseconds; the small k/v GEMVs also read
their weights at a lower rate than one wide one).

Loaders, checkpoints and the partition rules' storage paths keep the HF-shaped matrices (wq, wk,
wv, w_gate, w_up); `fuse_params` builds, per layer:
  wqkv [H, Hkv, G + 2, D]  KV head j's G = Hq / Hkv query heads, then its k, then its v (HF's
                           grouping: query head i reads KV head i // G). TP splits the Hkv axis,
                           so each device holds whole groups for any TP (where KV heads were
                           repeated up to TP, Hkv here is TP).
  bqkv [Hkv, G + 2, D]     the same for the biases (Qwen2).
  w_gate_up [H, 2, I]      gate then up; TP splits I, as it splits w_down's rows.
Quantised weights (jaxllm/models/quant.py) fuse the same way, each of their arrays along its
output axes.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.models.quant import map_out, shard_weight


def _fuse_layer(layer: dict, num_kv_heads: int) -> dict:
    layer = dict(layer)
    for prefix, fused_name in (("w", "wqkv"), ("b", "bqkv")):
        if f"{prefix}q" in layer:
            qkv = [layer.pop(f"{prefix}{name}") for name in "qkv"]
            layer[fused_name] = map_out(partial(_concat_heads, num_kv_heads=num_kv_heads), qkv)
    if "w_gate" in layer:
        layer["w_gate_up"] = map_out(lambda *gate_up: jnp.stack(gate_up, axis=-2),
                                     [layer.pop("w_gate"), layer.pop("w_up")])
    return layer


def _concat_heads(q, k, v, *, num_kv_heads: int):
    lead = q.shape[:-1]  # (H,) for weights, () for biases
    head_dim = k.shape[-1] // num_kv_heads
    return jnp.concatenate([x.reshape(*lead, num_kv_heads, -1, head_dim) for x in (q, k, v)],
                           axis=-2)


_fuse = jax.jit(_fuse_layer, static_argnums=1)
FUSED_NAMES = ("wqkv", "bqkv", "w_gate_up")


def fuse_params(params: dict, num_kv_heads: int, sharding_of: Callable | None = None, *,
                free_inputs: bool = False) -> dict:
    """params (storage layout) -> the compute layout forward runs on. num_kv_heads: as the step
    runs (after any repeat up to TP); sharding_of(path, shape): where each fused matrix lives on
    a mesh (None: one device); free_inputs: delete each layer's unfused matrices once fused, so
    the copy costs one layer of memory, not the model's (only where nothing else holds them)."""
    layers = []
    for index, layer in enumerate(params["layers"]):
        fused = _fuse(layer, num_kv_heads)
        if sharding_of is not None:
            fused = {name: shard_weight(value, sharding_of(f"layers.{index}.{name}", value.shape))
                     if name in FUSED_NAMES else value for name, value in fused.items()}
        if free_inputs:
            kept = {id(leaf) for leaf in jax.tree.leaves(fused)}  # a shared act-order perm
            for name in layer.keys() - fused.keys():
                for leaf in jax.tree.leaves(layer[name]):
                    if id(leaf) not in kept:
                        leaf.delete()
        layers.append(fused)
    return {**params, "layers": layers}
