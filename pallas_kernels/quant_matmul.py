"""W4A16 matmul: x [M, K] (16-bit or fp32) times a 4-bit matrix, its zero points and scales
applied per group on the accumulator rather than per weight.

The packed layout (loaders convert GPTQ and AWQ checkpoints to it on the host, integer ops only):
  qweight [K // 8, N] int32   rows in chunks of 128: word c * 16 + r holds, in its nibble j
                              (bits 4j..4j+3), row c * 128 + j * 16 + r of the 4-bit matrix.
                              So a nibble of a [16, BN] tile of words is 16 consecutive rows:
                              unpacking is a shift and a mask, never a reshape or interleave.
  scales  [K // group, N]     the group's scale (x's dtype)
  zeros   [K // group, N]     uint8, the group's zero point (8 for symmetric checkpoints)
  w[k, n] = (q[k, n] - zeros[k // group, n]) * scales[k // group, n]
scales and zeros may also come stacked across layers, [L, K // group, N] (stacked.py), read at
row `layer`. K must be a multiple of 128 and the group a multiple of 16 (GPTQ/AWQ use 32, 64, 128, or all
of K), so each 16-row slice lies in one group.

Zero point and scale leave the per-weight path: over the rows k of one group g,
  sum_k x[m, k] w[k, n] = s[g, n] * (sum_k x[m, k] q[k, n] - z[g, n] * sum_k x[m, k]),
so the kernel dots x with the raw nibbles and corrects a [BM, BN] accumulator once per group
(or once per 128-row chunk of a longer group: the correction is linear, so a group corrected
in parts sums to the same). Each nibble becomes a float by integer ops alone: its 4 bits set as
the top of the mantissa of 1.0 read 1 + q / 16 exactly in bf16, fp16 and fp32, with no
int -> float conversion (a slow instruction on the GPU) and no subtraction per weight; the
offset and the 1/16 fold into the group's correction:
  x . q - z * sum(x) = 16 * (x . (1 + q / 16) - (1 + z / 16) * sum(x)).

Programs: (M tile, N tile, K split). At decode M is a few rows, so the M x N tiles alone are too
few programs to stream the weights at full bandwidth (the 8B's o projection: 64 tiles for 132
SMs, each looping over all of K); K is then split into `splits` ranges whose fp32 partial
products the wrapper sums (deterministic, no atomics). One split writes x's dtype directly.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.split_sum import sum_splits
from pallas_kernels.stacked import check_stacked, prefix

CHUNK_ROWS = 128  # rows of one chunk of 16 words
_SLICE = 16  # rows per nibble of a chunk
_TARGET_PROGRAMS = 256  # about two per SM on an H200 (132 SMs)
_MIN_STEPS_PER_SPLIT = 4
# dtype -> (bits of 1.0, shift that puts a nibble at the top 4 bits of the mantissa)
_ONE_PLUS_NIBBLE = {jnp.dtype(jnp.bfloat16): (0x3F80, 3), jnp.dtype(jnp.float16): (0x3C00, 6),
                    jnp.dtype(jnp.float32): (0x3F800000, 19)}


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
    """x [M, K] @ the dequantised matrix (each weight rounded to x's dtype) -> [M, N] in x's
    dtype (fp32 accumulation)."""
    w = dequantize_int4(qweight, scales, zeros).astype(x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _check(x, qweight, scales, zeros, layer: int | None = None) -> int:
    """The group size; ValueError for shapes that do not fit (scales and zeros [K // group, N],
    or stacked [L, K // group, N] with `layer`)."""
    m, k = x.shape
    k8, n = qweight.shape
    if k != 8 * k8 or k % CHUNK_ROWS:
        raise ValueError(f"x {x.shape} and qweight {qweight.shape}: K must be 8 * qweight rows "
                         f"and a multiple of {CHUNK_ROWS}")
    groups = scales.shape[-2] if scales.ndim >= 2 else 0
    if not groups or k % groups:
        raise ValueError(f"scales {scales.shape} and zeros {zeros.shape} must be [K // group, {n}]")
    check_stacked("scales", scales, (groups, n), layer)
    check_stacked("zeros", zeros, (groups, n), layer)
    group = k // groups
    if group % _SLICE:
        raise ValueError(f"group size {group} must be a multiple of {_SLICE}")
    if jnp.dtype(x.dtype) not in _ONE_PLUS_NIBBLE:
        raise ValueError(f"x's dtype {x.dtype}: bfloat16, float16 or float32")
    return group


def _one_plus_nibble(words, j: int, dtype) -> jax.Array:
    """words [16, BN] int32 -> 1 + (nibble j) / 16 [16, BN] in dtype, exact, by integer ops: the
    nibble placed at the top of the mantissa of 1.0."""
    one, shift = _ONE_PLUS_NIBBLE[jnp.dtype(dtype)]
    offset = 4 * j - shift
    placed = words >> offset if offset >= 0 else words << -offset
    bits = (placed & (0xF << shift)) | one
    if jnp.dtype(dtype).itemsize == 2:
        bits = bits.astype(jnp.int16)
    return jax.lax.bitcast_convert_type(bits, dtype)


def _kernel(x_ref, q_ref, s_ref, z_ref, o_ref, *, group, block_m, block_n, chunks_per_split,
            layer):
    """o_ref [splits, M, N]: this split's x @ w over its K range, for one [BM, BN] tile."""
    m_total = x_ref.shape[0]
    n_total = q_ref.shape[1]
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m_total, cols < n_total
    slice_rows = jnp.arange(_SLICE, dtype=jnp.int32)
    # rows per correction: the group, or a chunk of a group longer than one
    part_rows = math.gcd(group, CHUNK_ROWS)
    slices_per_part = part_rows // _SLICE

    def correct(acc, part, xsum, k0):
        """acc + the part's rows' x @ w: part [BM, BN] = x . (1 + q / 16), xsum [BM] = sum(x)."""
        g = k0 // group
        scale = pltriton.load(s_ref.at[(*prefix(s_ref, 2, layer), g, cols)], mask=col_ok,
                              other=0).astype(jnp.float32)
        zero = pltriton.load(z_ref.at[(*prefix(z_ref, 2, layer), g, cols)], mask=col_ok,
                             other=0).astype(jnp.float32)
        return acc + (16 * scale)[None, :] * (part - (1 + zero / 16)[None, :] * xsum[:, None])

    def chunk(c, acc):
        words = pltriton.load(q_ref.at[c * _SLICE + slice_rows[:, None], cols[None, :]],
                              mask=col_ok[None, :], other=0)  # [16, BN]
        for p in range(CHUNK_ROWS // part_rows):
            part = jnp.zeros((block_m, block_n), jnp.float32)
            xsum = jnp.zeros((block_m,), jnp.float32)
            for j in range(p * slices_per_part, (p + 1) * slices_per_part):
                xs = pltriton.load(
                    x_ref.at[rows[:, None], c * CHUNK_ROWS + j * _SLICE + slice_rows[None, :]],
                    mask=row_ok[:, None], other=0)  # [BM, 16]
                # fp32 models get fp32 products, as the reference (no TF32)
                part += pltriton.dot(xs, _one_plus_nibble(words, j, xs.dtype), allow_tf32=False)
                xsum += jnp.sum(xs.astype(jnp.float32), axis=1)
            acc = correct(acc, part, xsum, c * CHUNK_ROWS + p * part_rows)
        return acc

    split = pl.program_id(2)
    first = split * chunks_per_split
    last = jnp.minimum(first + chunks_per_split, x_ref.shape[1] // CHUNK_ROWS)
    acc = jax.lax.fori_loop(first, last, chunk, jnp.zeros((block_m, block_n), jnp.float32))
    pltriton.store(o_ref.at[split, rows[:, None], cols[None, :]], acc.astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])


def default_block_n(m: int, k: int, n: int) -> int:
    """Columns per program: at decode (one 16-row M tile) the widest of 256 and 128 whose tiles,
    K split as far as num_k_splits would, still make _TARGET_PROGRAMS programs (a wider tile
    loads more weights per step: an H200 sweep, benchmarks/quant_linear_gpu.py); else 64."""
    if m <= 16:
        for block_n in (256, 128):
            most_splits = max(1, (k // CHUNK_ROWS) // _MIN_STEPS_PER_SPLIT)
            if pl.cdiv(n, block_n) * most_splits >= _TARGET_PROGRAMS:
                return block_n
    return 64


def num_k_splits(m: int, k: int, n: int, block_m: int, block_n: int,
                 block_k: int = CHUNK_ROWS) -> int:
    """K splits (of a loop over K in steps of block_k) that bring the programs to about
    _TARGET_PROGRAMS, each split at least _MIN_STEPS_PER_SPLIT steps long; 1 when the M x N
    tiles suffice."""
    tiles = pl.cdiv(m, block_m) * pl.cdiv(n, block_n)
    steps = pl.cdiv(k, block_k)
    splits = max(1, min(steps // _MIN_STEPS_PER_SPLIT, _TARGET_PROGRAMS // tiles))
    return pl.cdiv(steps, pl.cdiv(steps, splits))  # no split left empty


@functools.partial(jax.jit, static_argnames=("layer", "block_m", "block_n", "num_warps",
                                             "splits", "interpret"))
def int4_matmul(x, qweight, scales, zeros, *, layer: int | None = None,
                block_m: int | None = None,
                block_n: int | None = None, num_warps: int = 4, splits: int | None = None,
                interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel; same contract as `int4_matmul_reference` (closer to the
    exact product: no weight is rounded to x's dtype). One program: a [block_m, block_n] output
    tile over one K split, looping a chunk (16 words, 128 rows) at a time. block_n: default
    default_block_n; splits: K splits (default num_k_splits); layer: the row of stacked scales
    and zeros."""
    group = _check(x, qweight, scales, zeros, layer)
    (m, k), n = x.shape, qweight.shape[1]
    block_m = block_m or (16 if m <= 16 else 64)
    block_n = block_n or default_block_n(m, k, n)
    splits = splits or num_k_splits(m, k, n, block_m, block_n)
    chunks_per_split = pl.cdiv(k // CHUNK_ROWS, splits)
    kernel = functools.partial(_kernel, group=group, block_m=block_m, block_n=block_n,
                               chunks_per_split=chunks_per_split, layer=layer)
    out = pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret, name="int4_matmul",
    )(x, qweight, scales, zeros)
    return out[0] if splits == 1 else sum_splits(out).astype(x.dtype)
