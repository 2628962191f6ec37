"""KV write: this step's new K/V scattered into their cache slots (slot = page * P + offset),
per KV head: the cache is head-major, [N, Hkv, P, D] (ragged_paged_attention.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def to_cache(x: jax.Array, dtype, scale: float) -> jax.Array:
    """K or V rows as the cache stores them: divided by the cache's static scale, and for a
    float8 cache saturated to its range (a float8_e4m3fn cast would make NaN of the rest)."""
    if scale != 1.0:
        x = x.astype(jnp.float32) / scale
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8:
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def write_kv_reference(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
                       slot_mapping: jax.Array, *, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """k_cache, v_cache: [N, Hkv, P, D]; k, v: [T, Hkv, D]; slot_mapping: [T] int32, in range
    [0, N * P). A float8 cache stores k / k_scale and v / v_scale (static per-tensor scales;
    attention multiplies them back).

    A scatter at (page, :, offset), (page, offset) = divmod(slot, P), into the cache itself;
    with the cache donated, XLA updates it in place. (Scattering into a flattened view instead
    made XLA copy each whole cache twice per layer and step wherever a device holds one KV
    head.)
    """
    page_size = k_cache.shape[2]
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k, v = to_cache(k, k_cache.dtype, k_scale), to_cache(v, v_cache.dtype, v_scale)
    if k.shape[0] == 1:
        # One token: a dynamic_update_slice. XLA turns a one-row scatter into one too, but
        # behind a select that keeps the old row for an out-of-range slot: a kernel more per
        # cache. Slots are in range (the engine's padding writes to the reserved block 0).
        start = (page[0], 0, offset[0], 0)
        return (jax.lax.dynamic_update_slice(k_cache, k[:, :, None], start),
                jax.lax.dynamic_update_slice(v_cache, v[:, :, None], start))
    # advanced indices split by a slice: the update's axes are [T, Hkv, D], as k's
    return k_cache.at[page, :, offset].set(k), v_cache.at[page, :, offset].set(v)


# Pallas (Triton): one program per (block of tokens, KV head) stores its [tokens, D] rows into
# their rows of the flattened cache, (page * Hkv + head) * P + offset, aliased in place (donate
# it under jit).
_BLOCK_TOKENS = 16


def _write_kernel(slot_ref, k_ref, v_ref, k_cache_in, v_cache_in, k_cache_ref, v_cache_ref, *,
                  page_size, k_scale, v_scale):
    del k_cache_in, v_cache_in  # aliased to the outputs
    num_tokens, num_kv_heads, head_dim = k_ref.shape
    head = pl.program_id(1)
    token = pl.program_id(0) * _BLOCK_TOKENS + jnp.arange(_BLOCK_TOKENS, dtype=jnp.int32)
    valid = token < num_tokens
    slot = pltriton.load(slot_ref.at[token], mask=valid, other=0)  # [Bt]
    row = ((slot // page_size) * num_kv_heads + head) * page_size + slot % page_size  # [Bt]
    dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    src = (token[:, None], head, dims)
    dst = (row[:, None], dims)
    for src_ref, dst_ref, scale in ((k_ref, k_cache_ref, k_scale), (v_ref, v_cache_ref, v_scale)):
        rows = pltriton.load(src_ref.at[src], mask=valid[:, None], other=0)  # [Bt, D]
        pltriton.store(dst_ref.at[dst], to_cache(rows, dst_ref.dtype, scale), mask=valid[:, None])


def write_kv_pallas(k_cache, v_cache, k, v, slot_mapping, *, k_scale: float = 1.0,
                    v_scale: float = 1.0, interpret: bool = False):
    """Same contract as `write_kv_reference`, as a Pallas kernel writing the caches in place."""
    num_pages, num_kv_heads, page_size, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {k.shape}, v {v.shape} must be [T, {num_kv_heads}, {head_dim}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [{num_tokens}]")
    flat = (num_pages * num_kv_heads * page_size, head_dim)
    k_out, v_out = pl.pallas_call(
        functools.partial(_write_kernel, page_size=page_size, k_scale=k_scale, v_scale=v_scale),
        grid=(pl.cdiv(num_tokens, _BLOCK_TOKENS), num_kv_heads),
        out_shape=[jax.ShapeDtypeStruct(flat, k_cache.dtype)] * 2,
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_kv",
    )(slot_mapping, k, v, k_cache.reshape(flat), v_cache.reshape(flat))
    return k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)


def write_kv(k_cache, v_cache, k, v, slot_mapping, **scales):
    """The engine's KV write: the scatter. The Pallas kernel is faster alone, but in a whole step
    XLA fuses the rope and the V slice into the scatter and must materialise them for a custom
    call, which cancels the gain (docs/lab/)."""
    return write_kv_reference(k_cache, v_cache, k, v, slot_mapping, **scales)
