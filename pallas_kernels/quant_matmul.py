"""W4A16 matmul: x [M, K] (16-bit) times a 4-bit matrix dequantised inside the GEMM's K loop.

The packed layout (loaders convert GPTQ and AWQ checkpoints to it on the host, integer ops only):
  qweight [K // 8, N] int32   rows in chunks of 128: word c * 16 + r holds, in its nibble j
                              (bits 4j..4j+3), row c * 128 + j * 16 + r of the 4-bit matrix.
                              So a nibble of a [16, BN] tile of words is 16 consecutive rows:
                              unpacking is a shift and a mask, never a reshape or interleave.
  scales  [K // group, N]     the group's scale (x's dtype)
  zeros   [K // group, N]     uint8, the group's zero point (8 for symmetric checkpoints)
  w[k, n] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n]
K must be a multiple of 128 and the group a multiple of 16 (GPTQ/AWQ use 32, 64, 128), so each
16-row slice lies in one group.

Programs: (M tile, N tile, K split). At decode M is a few rows, so the M x N tiles alone are too
few programs to stream the weights at full bandwidth (the 8B's o projection: 64 tiles for 132
SMs, each looping over all of K); K is then split into `splits` ranges whose fp32 partial
products the wrapper sums (deterministic, no atomics). One split writes x's dtype directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

CHUNK_ROWS = 128  # rows of one chunk of 16 words
_SLICE = 16  # rows per nibble of a chunk
_TARGET_PROGRAMS = 256  # about two per SM on an H200 (132 SMs)
_MIN_CHUNKS_PER_SPLIT = 4


def pack_int4(q: np.ndarray) -> np.ndarray:
    """q [K, N] of 0..15 (numpy) -> qweight [K // 8, N] int32 in the layout above."""
    k, n = q.shape
    if k % CHUNK_ROWS:
        raise ValueError(f"K={k} must be a multiple of {CHUNK_ROWS}")
    nibbles = q.astype(np.uint32).reshape(k // CHUNK_ROWS, 8, _SLICE, n)  # [C, j, r, N]
    words = np.zeros((k // CHUNK_ROWS, _SLICE, n), np.uint32)
    for j in range(8):
        words |= nibbles[:, j] << np.uint32(4 * j)
    return words.reshape(k // 8, n).view(np.int32)


def unpack_int4(qweight: jax.Array) -> jax.Array:
    """qweight [K // 8, N] int32 -> [K, N] int32 of 0..15 (the inverse of pack_int4)."""
    k8, n = qweight.shape
    words = qweight.reshape(k8 // _SLICE, 1, _SLICE, n)
    shifts = (4 * jnp.arange(8, dtype=jnp.int32)).reshape(1, 8, 1, 1)
    return ((words >> shifts) & 0xF).reshape(k8 * 8, n)


def dequantize_int4(qweight, scales, zeros) -> jax.Array:
    """-> the [K, N] fp32 matrix."""
    q = unpack_int4(qweight).astype(jnp.float32)
    group = q.shape[0] // scales.shape[0]
    expand = lambda a: jnp.repeat(a.astype(jnp.float32), group, axis=0)
    return (q - expand(zeros)) * expand(scales)


def int4_matmul_reference(x, qweight, scales, zeros) -> jax.Array:
    """x [M, K] @ the dequantised matrix -> [M, N] in x's dtype (fp32 accumulation)."""
    w = dequantize_int4(qweight, scales, zeros).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _check(x, qweight, scales, zeros) -> int:
    m, k = x.shape
    k8, n = qweight.shape
    if k != 8 * k8 or k % CHUNK_ROWS:
        raise ValueError(f"x {x.shape} and qweight {qweight.shape}: K must be 8 * qweight rows "
                         f"and a multiple of {CHUNK_ROWS}")
    if scales.shape != zeros.shape or scales.shape[1] != n or k % scales.shape[0]:
        raise ValueError(f"scales {scales.shape} and zeros {zeros.shape} must be [K // group, {n}]")
    group = k // scales.shape[0]
    if group % _SLICE:
        raise ValueError(f"group size {group} must be a multiple of {_SLICE}")
    return group


def _kernel(x_ref, q_ref, s_ref, z_ref, o_ref, *, group, block_m, block_n, chunks_per_split):
    """o_ref [splits, M, N]: this split's x @ w over its K range, for one [BM, BN] tile."""
    m_total = x_ref.shape[0]
    n_total = q_ref.shape[1]
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m_total, cols < n_total
    slice_rows = jnp.arange(_SLICE, dtype=jnp.int32)

    def chunk(c, acc):
        words = pltriton.load(q_ref.at[c * _SLICE + slice_rows[:, None], cols[None, :]],
                              mask=col_ok[None, :], other=0)  # [16, BN]
        for j in range(8):
            k0 = c * CHUNK_ROWS + j * _SLICE
            g = k0 // group
            scale = pltriton.load(s_ref.at[g, cols], mask=col_ok, other=0).astype(jnp.float32)
            zero = pltriton.load(z_ref.at[g, cols], mask=col_ok, other=0).astype(jnp.float32)
            q = ((words >> (4 * j)) & 0xF).astype(jnp.float32)
            w = ((q - zero[None, :]) * scale[None, :]).astype(x_ref.dtype)  # [16, BN]
            xs = pltriton.load(x_ref.at[rows[:, None], k0 + slice_rows[None, :]],
                               mask=row_ok[:, None], other=0)  # [BM, 16]
            acc += pltriton.dot(xs, w, allow_tf32=False)  # fp32 models get fp32, as the reference
        return acc

    split = pl.program_id(2)
    first = split * chunks_per_split
    last = jnp.minimum(first + chunks_per_split, x_ref.shape[1] // CHUNK_ROWS)
    acc = jax.lax.fori_loop(first, last, chunk, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(o_ref.at[split, rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])


def num_k_splits(m: int, k: int, n: int, block_m: int, block_n: int) -> int:
    """K splits that bring the programs to about _TARGET_PROGRAMS, each split at least
    _MIN_CHUNKS_PER_SPLIT chunks long; 1 when the M x N tiles suffice."""
    tiles = pl.cdiv(m, block_m) * pl.cdiv(n, block_n)
    chunks = k // CHUNK_ROWS
    splits = max(1, min(chunks // _MIN_CHUNKS_PER_SPLIT, _TARGET_PROGRAMS // tiles))
    return pl.cdiv(chunks, pl.cdiv(chunks, splits))  # no split left empty


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "splits", "interpret"))
def int4_matmul(x, qweight, scales, zeros, *, block_m: int | None = None, block_n: int = 64,
                splits: int | None = None, interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel; same contract as `int4_matmul_reference`. One program: a
    [block_m, block_n] output tile over one K split, looping a chunk (16 words, 128 rows) at a
    time. splits: K splits (default num_k_splits)."""
    group = _check(x, qweight, scales, zeros)
    (m, k), n = x.shape, qweight.shape[1]
    block_m = block_m or (16 if m <= 16 else 64)
    splits = splits or num_k_splits(m, k, n, block_m, block_n)
    chunks_per_split = pl.cdiv(k // CHUNK_ROWS, splits)
    kernel = functools.partial(_kernel, group=group, block_m=block_m, block_n=block_n,
                               chunks_per_split=chunks_per_split)
    out = pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret, name="int4_matmul",
    )(x, qweight, scales, zeros)
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
