"""A candidate: a decoder layer's rope, q/k/v split and KV write as one Pallas (Triton) kernel on
the fused qkv projection's output. Not the product's until an H200 run times it in a step
(`rope_kv_write_gpu.py`); the product runs apply_rope and kv_write.write_kv_reference apart.

  qkv          [T, Hkv, G + 2, D]  the model's dtype: per KV head its G query heads, then k, v
  cos, sin     [T, 1, D // 2]      fp32 (models/layers.py's rope_cos_sin), HF's half-split rope
  slot_mapping [T] int32           slot = page * P + offset
  k_cache      [N, P, Hkv, D]      written in place (aliased: donate it under jit)
  v_cache      [N, P, Hkv, D]
  ->  q [T, Hkv, G, D] (rotated, the model's dtype), k_cache, v_cache

Why: at batch 1, XLA runs the rope, the split and the write as four to five launch-bound kernels a
layer (the q rope, the k rope fused with the cache's select of the old slot, v's select, the
cache updates; docs/lab/2026-12-02-session21.md), about 0.26 ms of a ~3 ms FP8 step. One program
per (block of tokens, KV head) reads that head's G + 2 rows once, rotates q and k in fp32 (as
apply_rope), stores q, and writes k and v to their slots as kv_write does (divided by a static
scale, saturated to a float8 cache's range). Loads past T read 0 and every store is masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.kv_write import to_cache, write_kv_reference

_BLOCK_TOKENS = 16


def rotate(x1, x2, cos, sin):
    """HF's rotate_half rope on a row's halves x1, x2 (fp32): the rotated halves."""
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, slot_mapping, *,
                            k_scale: float = 1.0, v_scale: float = 1.0):
    """The contract in jnp: the split, the rope in fp32, then kv_write's scatter."""
    group = qkv.shape[2] - 2
    half = qkv.shape[3] // 2
    x = qkv[:, :, :group + 1].astype(jnp.float32)  # q heads and k
    lo, hi = rotate(x[..., :half], x[..., half:], cos[:, :, None], sin[:, :, None])
    qk = jnp.concatenate([lo, hi], axis=-1).astype(qkv.dtype)
    k_cache, v_cache = write_kv_reference(k_cache, v_cache, qk[:, :, group], qkv[:, :, group + 1],
                                          slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return qk[:, :, :group], k_cache, v_cache


def _kernel(qkv_ref, cos_ref, sin_ref, slot_ref, k_in, v_in, q_ref, k_cache_ref, v_cache_ref, *,
            k_scale, v_scale):
    del k_in, v_in  # aliased to the outputs
    num_tokens, _, width, head_dim = qkv_ref.shape
    group, half = width - 2, head_dim // 2
    head = pl.program_id(1)
    token = pl.program_id(0) * _BLOCK_TOKENS + jnp.arange(_BLOCK_TOKENS, dtype=jnp.int32)
    valid = token < num_tokens
    rows = valid[:, None]
    t = token[:, None]
    lo = jnp.arange(half, dtype=jnp.int32)[None, :]
    hi = lo + half
    cos = pltriton.load(cos_ref.at[t, 0, lo], mask=rows, other=0)  # [Bt, D / 2]
    sin = pltriton.load(sin_ref.at[t, 0, lo], mask=rows, other=0)
    slot = pltriton.load(slot_ref.at[token], mask=valid, other=0)[:, None]  # [Bt, 1]

    def rotated(j):
        x1 = pltriton.load(qkv_ref.at[t, head, j, lo], mask=rows, other=0).astype(jnp.float32)
        x2 = pltriton.load(qkv_ref.at[t, head, j, hi], mask=rows, other=0).astype(jnp.float32)
        return rotate(x1, x2, cos, sin)

    for j in range(group):
        for idx, part in zip((lo, hi), rotated(j)):
            pltriton.store(q_ref.at[t, head, j, idx], part.astype(q_ref.dtype), mask=rows)
    for idx, part in zip((lo, hi), rotated(group)):
        k = part.astype(qkv_ref.dtype)  # rounded as the product rounds k before the write
        pltriton.store(k_cache_ref.at[slot, head, idx], to_cache(k, k_cache_ref.dtype, k_scale),
                       mask=rows)
    dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    v = pltriton.load(qkv_ref.at[t, head, group + 1, dims], mask=rows, other=0)
    pltriton.store(v_cache_ref.at[slot, head, dims], to_cache(v, v_cache_ref.dtype, v_scale),
                   mask=rows)


@functools.partial(jax.jit, static_argnames=("k_scale", "v_scale", "interpret"),
                   donate_argnums=(3, 4))
def rope_kv_write(qkv, cos, sin, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0,
                  v_scale: float = 1.0, interpret: bool = False):
    """The Pallas kernel; `rope_kv_write_reference`'s contract (the caches donated)."""
    num_tokens, num_kv_heads, width, head_dim = qkv.shape
    num_pages, page_size = k_cache.shape[:2]
    if (k_cache.shape != (num_pages, page_size, num_kv_heads, head_dim)
            or v_cache.shape != k_cache.shape or width < 3 or head_dim % 2
            or cos.shape != (num_tokens, 1, head_dim // 2) or sin.shape != cos.shape
            or slot_mapping.shape != (num_tokens,)):
        raise ValueError(f"qkv {qkv.shape}, cos {cos.shape}, sin {sin.shape}, slots "
                         f"{slot_mapping.shape}, caches {k_cache.shape} {v_cache.shape}: want "
                         f"[T, Hkv, G + 2, D], [T, 1, D / 2] twice, [T], [N, P, Hkv, D] twice")
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    q, k_out, v_out = pl.pallas_call(
        functools.partial(_kernel, k_scale=k_scale, v_scale=v_scale),
        grid=(pl.cdiv(num_tokens, _BLOCK_TOKENS), num_kv_heads),
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_kv_heads, width - 2, head_dim),
                                        qkv.dtype),
                   jax.ShapeDtypeStruct(flat, k_cache.dtype),
                   jax.ShapeDtypeStruct(flat, v_cache.dtype)],
        input_output_aliases={4: 1, 5: 2},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="rope_kv_write",
    )(qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), slot_mapping,
      k_cache.reshape(flat), v_cache.reshape(flat))
    return q, k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)
