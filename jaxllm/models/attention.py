"""The attention backends a model's layers can run: the paged-attention kernel and its KV write."""

from __future__ import annotations

import functools
from typing import Callable

import jax

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
                              implementation=implementation), kv_write.write_kv)
