"""The attention backends a model's layers can run: the paged-attention kernel and its KV write."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from jaxllm.models.layer_stacks import in_place
from jaxllm.models.quant import ScaledProduct, SplitProduct
from pallas_kernels import kv_write, ragged_paged_attention


def attention_backend(name: str) -> tuple[Callable, Callable]:
    """-> (attention, KV write). pallas: the Triton kernel, and the Mosaic GPU one for prefill
    buckets on Hopper; triton / mosaic: that kernel for every bucket; xla: the jnp reference;
    auto: pallas on a GPU, xla elsewhere."""
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "xla"
    if name == "xla":
        return ragged_paged_attention.ragged_paged_attention_reference, kv_write.write_kv_reference
    implementation = None if name == "pallas" else name
    return (functools.partial(ragged_paged_attention.ragged_paged_attention,
                              implementation=implementation), RopeKVWrite())


@dataclasses.dataclass(frozen=True)
class RopeKVWrite:
    """The Pallas backends' KV write: called as any KV write (caches, k, v, slot_mapping ->
    caches), and with `rope_write` also the rope, one kernel where XLA makes three
    (pallas_kernels/kv_write.py). A model takes rope_write where a KV write has it and its
    layer is plain rope (transformer.py); on a mesh the KV write is the sharded plain one.
    interpret: the kernel in interpret mode (off a GPU, tests)."""
    interpret: bool = False

    def __call__(self, k_cache, v_cache, k, v, slot_mapping):
        return kv_write.write_kv(k_cache, v_cache, k, v, slot_mapping)

    def rope_write(self, k_cache, v_cache, qkv, cos, sin, slot_mapping):
        """qkv [T, Hkv, G + 2, D], or an FP8 projection's unfinished output (a W8A8 GEMM's
        quant.ScaledProduct, a K-split GEMV's quant.SplitProduct) finished in the kernel; cos,
        sin [T, 1, D / 2] -> (q [T, Hq, D] roped, caches)."""
        kw = {}
        if isinstance(qkv, ScaledProduct):
            w_scale, layer = in_place(qkv.w_scale)
            kw = dict(product_scales=(qkv.x_scale[:, 0], w_scale), dtype=qkv.dtype, layer=layer)
            qkv = qkv.y
        elif isinstance(qkv, SplitProduct):
            parts, sumsq = qkv.splits
            kw = dict(splits=(sumsq, qkv.k, qkv.eps), dtype=qkv.dtype)
            qkv = parts.reshape(*parts.shape[:2], *qkv.out_shape)
        return kv_write.rope_write_kv(k_cache, v_cache, qkv, cos, sin, slot_mapping,
                                      interpret=self.interpret, **kw)
