"""KV write: this step's new K/V scattered into their cache slots (slot = page * P + offset),
per KV head: the cache is head-major, [N, Hkv, P, D] (ragged_paged_attention.py).

The rope and KV write (`rope_write_kv`): from the fused QKV GEMM's output, q roped out and k
roped and v into their slots, one kernel, an FP8 projection's unfinished output (its scales,
or its K split's sum and norm) finished as it is read. Alone, XLA makes three of it or more
(the K scatter with k's rope inside, the V scatter, q's rope, the product's end), each a launch
in a decode step of ~10 kernels a layer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp8_gemv import Splits, finish_splits
from pallas_kernels.stacked import check_stacked, prefix


def is_float8(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def to_cache(x: jax.Array, dtype, scale: float) -> jax.Array:
    """K or V rows as the cache stores them: divided by the cache's static scale, and for a
    float8 cache saturated to its range (a float8_e4m3fn cast would make NaN of the rest)."""
    if scale != 1.0:
        x = x.astype(jnp.float32) / scale
    if is_float8(dtype):
        limit = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -limit, limit)
    return x.astype(dtype)


def rope_reference(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, D] rotated in HF's half-split layout (rotate_half) by cos, sin [T, 1, D / 2]
    (float32), in fp32, to x's dtype."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


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
    update = functools.partial(_update_slots, page=page, offset=offset)
    # XLA's CPU backend widens a whole float8 array to scatter into it or update a slice of it:
    # there the cache's bits, as uint8, are updated instead.
    return float8_as_bits_on_cpu(k_cache.dtype, update, functools.partial(
        _update_bits, update=update), k_cache, v_cache, k, v)


def float8_as_bits_on_cpu(cache_dtype, run, run_on_bits, *args):
    """run(*args); for a float8 cache, run_on_bits(*args) where it runs on a CPU (XLA's CPU
    backend widens whole float8 arrays to float16 for many ops, so there they go as uint8)."""
    if not is_float8(cache_dtype):
        return run(*args)
    return jax.lax.platform_dependent(*args, cpu=run_on_bits, default=run)


def _update_slots(k_cache, v_cache, k, v, *, page, offset):
    if k.shape[0] == 1:
        # One token: a dynamic_update_slice. XLA turns a one-row scatter into one too, but
        # behind a select that keeps the old row for an out-of-range slot: a kernel more per
        # cache. Slots are in range (the engine's padding writes to the reserved block 0).
        start = (page[0], 0, offset[0], 0)
        return (jax.lax.dynamic_update_slice(k_cache, k[:, :, None], start),
                jax.lax.dynamic_update_slice(v_cache, v[:, :, None], start))
    # advanced indices split by a slice: the update's axes are [T, Hkv, D], as k's
    return k_cache.at[page, :, offset].set(k), v_cache.at[page, :, offset].set(v)


def _update_bits(k_cache, v_cache, k, v, *, update):
    bits = [jax.lax.bitcast_convert_type(x, jnp.uint8) for x in (k_cache, v_cache, k, v)]
    return tuple(jax.lax.bitcast_convert_type(x, k_cache.dtype) for x in update(*bits))


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


def rope_write_kv_reference(k_cache: jax.Array, v_cache: jax.Array, qkv: jax.Array,
                            cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array, *,
                            k_scale: float = 1.0, v_scale: float = 1.0,
                            product_scales: tuple[jax.Array, jax.Array] | None = None,
                            splits: tuple[jax.Array | None, int, float] | None = None,
                            dtype=None):
    """qkv [T, Hkv, G + 2, D]: each KV head's G query heads, then its k and v (the fused QKV
    GEMM's layout); cos, sin [T, 1, D / 2] float32 -> (q [T, Hkv * G, D] roped, and the caches
    with k roped and v written as `write_kv_reference` writes them). qkv may come unfinished,
    finished to `dtype` (the projection's output) before the rope:
    - product_scales: an FP8 GEMM's product before its scales (per token [T], per channel
      [Hkv, G + 2, D]), applied in fp32;
    - splits = (sumsq [S, T] or None, k, eps): qkv is [S, T, Hkv, G + 2, D], a K-split GEMV's
      fp32 partial products, finished as fp8_gemv.finish_splits (summed in split order, times
      the RMS of x's rows over k when the GEMV took the input norm)."""
    if product_scales is not None:
        row, col = product_scales
        qkv = (qkv.astype(jnp.float32) * row[:, None, None, None] * col).astype(dtype)
    if splits is not None:
        sumsq, k, eps = splits
        parts = Splits(qkv.reshape(*qkv.shape[:2], -1), sumsq)
        qkv = finish_splits(parts, k, eps, dtype).reshape(qkv.shape[1:])
    num_tokens, _, width, head_dim = qkv.shape
    q = rope_reference(qkv[:, :, :width - 2].reshape(num_tokens, -1, head_dim), cos, sin)
    k = rope_reference(qkv[:, :, width - 2], cos, sin)
    return (q, *write_kv_reference(k_cache, v_cache, k, qkv[:, :, width - 1], slot_mapping,
                                   k_scale=k_scale, v_scale=v_scale))


def _rope_write_kernel(slot_ref, qkv_ref, cos_ref, sin_ref, *refs, page_size, k_scale, v_scale,
                       source, layer, split_k, eps):
    """One (block of tokens, KV head): its G query heads roped into q_ref [T, Hq, D], its k
    roped and its v stored into their cache rows. Each head is read as two halves [Bt, D / 2],
    the rope's pairs. source: how qkv comes (rope_write_kv_reference's options): "plain";
    "scaled", refs then starting with the token and channel scales ([T] and
    [(L,) Hkv, G + 2, D], at row `layer`); "splits" (qkv [S, T, ...] fp32) or "splits+norm",
    refs then starting with the sums of squares [S, T]. Then the caches (aliased to the
    outputs), q_ref and the caches' outputs."""
    lead = {"plain": 0, "scaled": 2, "splits": 0, "splits+norm": 1}[source]
    extra, (_, _, q_ref, k_cache_ref, v_cache_ref) = refs[:lead], refs[lead:]
    num_splits = qkv_ref.shape[0] if source.startswith("splits") else None
    num_tokens, num_kv_heads, width, head_dim = qkv_ref.shape[-4:]
    group, half = width - 2, head_dim // 2
    head = pl.program_id(1)
    token = pl.program_id(0) * _BLOCK_TOKENS + jnp.arange(_BLOCK_TOKENS, dtype=jnp.int32)
    valid = token < num_tokens
    rows, live = token[:, None], valid[:, None]
    dims = jnp.arange(half, dtype=jnp.int32)[None, :]
    cos = pltriton.load(cos_ref.at[rows, dims], mask=live, other=0)  # [Bt, D / 2] fp32
    sin = pltriton.load(sin_ref.at[rows, dims], mask=live, other=0)
    if source == "scaled":
        row_ref, col_ref = extra
        token_scale = pltriton.load(row_ref.at[token], mask=valid, other=0)[:, None]
        col_row = prefix(col_ref, 3, layer)
    if source == "splits+norm":  # the RMS of each token's x, as the GEMV's wrapper takes it
        sumsq = functools.reduce(jnp.add, (pltriton.load(extra[0].at[s, token], mask=valid,
                                                         other=0) for s in range(num_splits)))
        rms = jax.lax.rsqrt(sumsq / split_k + eps)[:, None]

    def load(j, h):  # head j's half at h: [Bt, D / 2] as it comes
        if num_splits is None:
            return pltriton.load(qkv_ref.at[rows, head, j, dims + h], mask=live, other=0)
        return functools.reduce(jnp.add, (
            pltriton.load(qkv_ref.at[s, rows, head, j, dims + h], mask=live, other=0)
            for s in range(num_splits)))

    def halves(j):
        """Head j's halves [Bt, D / 2] in the output's dtype (finished first)."""
        parts = tuple(load(j, h) for h in (0, half))
        if source == "scaled":
            cols = tuple(pltriton.load(col_ref.at[(*col_row, head, j, dims + h)])
                         for h in (0, half))
            parts = tuple(x.astype(jnp.float32) * token_scale * c for x, c in zip(parts, cols))
        elif source == "splits+norm":
            parts = tuple(x * rms for x in parts)
        return tuple(x.astype(q_ref.dtype) for x in parts)

    def roped(j):
        x1, x2 = (x.astype(jnp.float32) for x in halves(j))
        return tuple(x.astype(q_ref.dtype) for x in (x1 * cos - x2 * sin, x2 * cos + x1 * sin))

    for j in range(group):
        for h, x in zip((0, half), roped(j)):
            pltriton.store(q_ref.at[rows, head * group + j, dims + h], x, mask=live)
    slot = pltriton.load(slot_ref.at[token], mask=valid, other=0)  # [Bt]
    dst = (((slot // page_size) * num_kv_heads + head) * page_size + slot % page_size)[:, None]
    for cache_ref, scale, parts in ((k_cache_ref, k_scale, roped(group)),
                                    (v_cache_ref, v_scale, halves(group + 1))):
        for h, x in zip((0, half), parts):
            pltriton.store(cache_ref.at[dst, dims + h], to_cache(x, cache_ref.dtype, scale),
                           mask=live)


def rope_write_kv(k_cache, v_cache, qkv, cos, sin, slot_mapping, *, k_scale: float = 1.0,
                  v_scale: float = 1.0, product_scales=None, splits=None, dtype=None,
                  layer: int | None = None, interpret: bool = False):
    """`rope_write_kv_reference`'s contract as one Pallas kernel, the caches written in place
    (donate them under jit). The channel scales of product_scales may come stacked across
    layers, [L, Hkv, G + 2, D], read at row `layer` (stacked.py)."""
    num_pages, num_kv_heads, page_size, head_dim = k_cache.shape
    heads = qkv.shape[1:] if splits is None else qkv.shape[2:]
    num_tokens, width = qkv.shape[-4], heads[1]
    if heads != (num_kv_heads, width, head_dim) or width < 3 or head_dim % 2:
        raise ValueError(f"qkv {qkv.shape} must be [{'' if splits is None else 'S, '}T, "
                         f"{num_kv_heads}, G + 2, {head_dim}]")
    if cos.shape != sin.shape or cos.size != num_tokens * head_dim // 2:
        raise ValueError(f"cos {cos.shape}, sin {sin.shape} must be [{num_tokens}, 1, "
                         f"{head_dim // 2}]")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {slot_mapping.shape} must be [{num_tokens}]")
    if product_scales is not None and splits is not None:
        raise ValueError("product_scales and splits: qkv comes one way")
    extra, source, split_k, eps = (), "plain", 0, 0.0
    if product_scales is not None:
        row, col = product_scales
        check_stacked("product_scales' channel scales", col, heads, layer)
        if row.shape != (num_tokens,):
            raise ValueError(f"product_scales' token scales {row.shape}: want [{num_tokens}]")
        extra, source = (row.astype(jnp.float32), col.astype(jnp.float32)), "scaled"
    if splits is not None:
        sumsq, split_k, eps = splits
        if sumsq is not None and sumsq.shape != qkv.shape[:2]:
            raise ValueError(f"splits' sums of squares {sumsq.shape}: want {qkv.shape[:2]}")
        extra, source = ((), "splits") if sumsq is None else ((sumsq,), "splits+norm")
    if source != "plain" and dtype is None:
        raise ValueError("an unfinished qkv (product_scales or splits) needs dtype: the "
                         "projection's output dtype, which q is written in")
    flat = (num_pages * num_kv_heads * page_size, head_dim)
    angles = (num_tokens, head_dim // 2)
    inputs = (slot_mapping, qkv, cos.reshape(angles).astype(jnp.float32),
              sin.reshape(angles).astype(jnp.float32), *extra)
    q, k_out, v_out = pl.pallas_call(
        functools.partial(_rope_write_kernel, page_size=page_size, k_scale=k_scale,
                          v_scale=v_scale, source=source, layer=layer, split_k=split_k,
                          eps=eps),
        grid=(pl.cdiv(num_tokens, _BLOCK_TOKENS), num_kv_heads),
        out_shape=[jax.ShapeDtypeStruct((num_tokens, num_kv_heads * (width - 2), head_dim),
                                        dtype or qkv.dtype),
                   jax.ShapeDtypeStruct(flat, k_cache.dtype),
                   jax.ShapeDtypeStruct(flat, v_cache.dtype)],
        input_output_aliases={len(inputs): 1, len(inputs) + 1: 2},
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="rope_write_kv",
    )(*inputs, k_cache.reshape(flat), v_cache.reshape(flat))
    return q, k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)


def write_kv(k_cache, v_cache, k, v, slot_mapping, **scales):
    """The engine's KV write: the scatter. The Pallas kernel is faster alone, but in a whole step
    XLA fuses the rope and the V slice into the scatter and must materialise them for a custom
    call, which cancels the gain (docs/lab/)."""
    return write_kv_reference(k_cache, v_cache, k, v, slot_mapping, **scales)
