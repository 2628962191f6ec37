"""W4A16 GEMV: a few rows of x (decode's tokens) times a 4-bit matrix in quant_matmul's packed
layout, on the CUDA cores: the nibbles widened in registers, x never quantised, no dot.

  x       [M, K]           bf16, f16 or f32; M small (a decode step's tokens)
  qweight [K // 8, N]      int32, quant_matmul's chunks: word c * 16 + r holds, in its nibble j,
                           row c * 128 + j * 16 + r (N minor)
  scales  [K // group, N]  x's dtype
  zeros   [K // group, N]  uint8
  ->      [M, N]           in x's dtype: quant_matmul.int4_matmul_reference's contract, fp32
                           math (no weight rounded to x's dtype)

With few rows the product is a weight read (half a byte a weight, a scale and a zero point a
group): the work is to stream qweight at HBM bandwidth and to spend few instructions per weight.
quant_matmul.int4_matmul pads one row to a 16-row tile for the tensor cores' K = 16 dots, whose
operand layouts cost more than the weight read at batch 1; here a weight costs a shift, one
LOP3 (mask and OR: quant_matmul's bit moves, 1 + q / 16 in fp32) and one FMA per row of x. The
CUDA cores issue about 3.5 instructions a weight at HBM rate, so each one counts: x's loads,
conversions and sums are per row of the tile and column of a thread, so wider tiles (more
columns a thread) spend fewer of them a weight.

Programs: (N tile, K split). A program owns `block_n` columns and a range of 128-row chunks. Per
chunk it first issues every global read (the [16, block_n] tile of words, N minor: coalesced;
the chunk's scales and zeros; evicted first, so that x, re-read per chunk, stays cached), one
latency a chunk that the SM's other warps hide (Triton's pipeliner leaves a loop without a dot
alone). Then, for each nibble j and each row m of x (a static loop), it accumulates part[m] +=
(1 + q / 16) * x[m, chunk's row j * 16 + r] with x broadcast over the columns: elementwise
[16, block_n] FMAs, no layout conversion (only the scales' [block_n] vectors, once a part).
Zero point and scale apply once per part (a group, or each 128-row chunk of a longer group; the
correction is linear, so a group corrected in parts sums to the same), quant_matmul's identity
  sum_k x w = 16 * s * (sum_k x (1 + q / 16) - (1 + z / 16) * sum_k x)
taken per lane r: xsum[m] [16] holds x's sums over the part's rows j * 16 + r, so the
correction is elementwise too and acc's 16 rows are summed once, before the store.

When N / block_n tiles are too few to keep every SM streaming (an o projection: N = 4096), K is
split into `splits` ranges of whole chunks whose fp32 partial products the wrapper sums
(deterministic, no atomics); a single split writes x's dtype directly. Loads past N read 0 and
every store is masked to the live columns; the static loop covers x's rows and no more.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import quant_matmul
from pallas_kernels.quant_matmul import CHUNK_ROWS

_SLICE = 16  # rows per nibble of a chunk: the words tile's rows
# Tiles from the H200 sweep (experiments/int4_gemv_gpu.py): wide tiles and short K ranges
# (many programs) were fastest on each of the 8B's four projections.
DEFAULT_BLOCK_N = 256  # a [16, 256] words tile: 64 bytes a thread at 8 warps
DEFAULT_NUM_WARPS = 8
_TARGET_PROGRAMS = 896  # about seven per SM on an H200 (132 SMs)
_MIN_CHUNKS_PER_SPLIT = 2
_ONE, _MANTISSA_TOP = quant_matmul._ONE_PLUS_NIBBLE[jnp.dtype(jnp.float32)]  # 1.0's bits, 19
_NIBBLE_MASK = 0xF << _MANTISSA_TOP

int4_gemv_reference = quant_matmul.int4_matmul_reference  # the contract


def _load(ref, mask):
    """A streamed read (weights, scales, zeros: used once), 0 where masked off."""
    return pltriton.load(ref, mask=mask, other=0, eviction_policy="evict_first")


def _one_plus_nibble(words, high, j, one):
    """1 + (nibble j) / 16 [16, BN] fp32, exact: quant_matmul's bit moves, the nibble shifted
    left to the top of the mantissa (bits 19..22), masked, OR'd with 1.0's bits. high: words
    >> 16, so that every nibble shifts left (an IMAD, off the integer pipe the LOP3s load)."""
    src = words if j < 4 else high
    return jax.lax.bitcast_convert_type(((src << (_MANTISSA_TOP - 4 * (j % 4))) & _NIBBLE_MASK)
                                        | one, jnp.float32)


def _kernel(one_ref, x_ref, q_ref, s_ref, z_ref, o_ref, *, group, block_n, chunks_per_split):
    """o_ref [splits, M, N]: this split's x @ w over its chunks, for one N tile. one_ref [1]:
    1.0's bits, read at run time so that the mask and the OR fuse into one LOP3 (LOP3 takes one
    immediate: two constants cost two)."""
    num_rows = x_ref.shape[0]
    one = one_ref[0]
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < q_ref.shape[1]
    lanes = jnp.arange(_SLICE, dtype=jnp.int32)
    part_rows = math.gcd(group, CHUNK_ROWS)  # rows per correction
    nibbles_per_part = part_rows // _SLICE

    def corrections(c):
        """Per part of chunk c: (16 s, 16 s (1 + z / 16)) [BN] of its group."""
        out = []
        for p in range(CHUNK_ROWS // part_rows):
            g = (c * CHUNK_ROWS + p * part_rows) // group
            s16 = 16 * _load(s_ref.at[g, cols], col_ok).astype(jnp.float32)
            out.append((s16, s16 * (1 + _load(z_ref.at[g, cols], col_ok).astype(jnp.float32) / 16)))
        return out

    def chunk(c, acc):  # acc: M x [16, BN]
        # every global read of the chunk first: one latency a chunk, hidden by other warps
        words = _load(q_ref.at[c * _SLICE + lanes[:, None], cols[None, :]], col_ok[None, :])
        high = words >> 16
        for p, (s16, zs16) in enumerate(corrections(c)):
            part = [jnp.zeros((_SLICE, block_n), jnp.float32)] * num_rows
            xsum = [jnp.zeros((_SLICE,), jnp.float32)] * num_rows
            for j in range(p * nibbles_per_part, (p + 1) * nibbles_per_part):
                # fp32 whatever x's dtype: x's products and sums stay fp32
                f = _one_plus_nibble(words, high, j, one)  # [16, BN]
                for m in range(num_rows):
                    xs = pltriton.load(x_ref.at[m, c * CHUNK_ROWS + j * _SLICE + lanes])
                    xs = xs.astype(jnp.float32)
                    part[m] = part[m] + f * xs[:, None]
                    xsum[m] = xsum[m] + xs
            # the part's x @ w, lane by lane (acc's 16 rows summed at the end)
            acc = tuple(a + s16[None] * pm - zs16[None] * xm[:, None]
                        for a, pm, xm in zip(acc, part, xsum))
        return acc

    split = pl.program_id(1)
    first = split * chunks_per_split
    last = jnp.minimum(first + chunks_per_split, x_ref.shape[1] // CHUNK_ROWS)
    acc = jax.lax.fori_loop(first, last, chunk, tuple(
        jnp.zeros((_SLICE, block_n), jnp.float32) for _ in range(num_rows)))
    for m in range(num_rows):
        pltriton.store(o_ref.at[split, m, cols], jnp.sum(acc[m], axis=0).astype(o_ref.dtype),
                       mask=col_ok)


def _whole_splits(chunks: int, splits: int) -> int:
    """The fewest splits of the same length: none left empty, none past the chunks."""
    return pl.cdiv(chunks, pl.cdiv(chunks, splits))


def default_splits(n: int, k: int, block_n: int) -> int:
    """K splits that bring the programs to about _TARGET_PROGRAMS, each at least
    _MIN_CHUNKS_PER_SPLIT chunks long; 1 when the N tiles alone suffice."""
    chunks = k // CHUNK_ROWS
    splits = max(1, min(chunks // _MIN_CHUNKS_PER_SPLIT, _TARGET_PROGRAMS // pl.cdiv(n, block_n)))
    return _whole_splits(chunks, splits)


@functools.partial(jax.jit, static_argnames=("block_n", "splits", "num_warps", "num_stages",
                                             "interpret"))
def int4_gemv(x: jax.Array, qweight: jax.Array, scales: jax.Array, zeros: jax.Array, *,
              block_n: int | None = None, splits: int | None = None, num_warps: int = DEFAULT_NUM_WARPS,
              num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel; `int4_gemv_reference`'s contract. block_n: columns a program
    (a power of two, default DEFAULT_BLOCK_N); splits: K ranges (default default_splits, a
    count leaving a range empty lowered to the fewest of the same length); num_warps,
    num_stages: Triton's."""
    group = quant_matmul._check(x, qweight, scales, zeros)
    (m, k), n = x.shape, qweight.shape[1]
    block_n = min(block_n or DEFAULT_BLOCK_N, max(_SLICE, pl.next_power_of_2(n)))
    if block_n & (block_n - 1) or (splits is not None and splits < 1):
        raise ValueError(f"block_n {block_n}: a power of two; splits {splits}: at least 1")
    chunks = k // CHUNK_ROWS
    splits = _whole_splits(chunks, splits or default_splits(n, k, block_n))
    out = pl.pallas_call(
        functools.partial(_kernel, group=group, block_n=block_n,
                          chunks_per_split=pl.cdiv(chunks, splits)),
        grid=(pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int4_gemv",
    )(jnp.full((1,), _ONE, jnp.int32), x, qweight, scales, zeros)
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
