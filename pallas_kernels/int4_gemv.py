"""W4A16 GEMV: a few rows of x (decode's tokens) times a 4-bit matrix in quant_matmul's packed
layout, on the CUDA cores in half2: the nibbles widened two at a time into packed fp16 pairs and
multiplied by x's pairs, x never quantised, no dot.

  x       [M, K]           bf16, f16 or f32; M small (a decode step's tokens)
  qweight [K // 8, N]      int32, quant_matmul's chunks: word c * 16 + r holds, in its nibble j,
                           row c * 128 + j * 16 + r (N minor)
  scales  [K // group, N]  x's dtype; group 32, 64 or a multiple of 128
  zeros   [K // group, N]  uint8
  ->      [M, N]           in x's dtype: quant_matmul.int4_matmul_reference's contract
  (scales and zeros may also come stacked across layers, read at row `layer`: stacked.py)

With few rows the product is a weight read (half a byte a weight, a scale and a zero point a
group): the work is to stream qweight at HBM bandwidth, and the CUDA cores' issue rate bounds it
first, so the instructions a weight are what the kernel saves. A word (8 nibbles: rows j * 16 + r
of a 128-row chunk) costs a shift and 4 LOP3s (each masks two nibbles, at bits 0-3 and 16-19 or
4-7 and 20-23, and ORs in 1024.0's fp16 bits: 1024 + n or 1024 + 16 n, exact), 4 half2
subtractions / FMAs removing that bias, 4 half2 multiplies / FMAs with x's pairs (rows j and
j + 4) and 2 widenings to fp32 (one half2 add first for groups of 64 rows and more); then one
fp32 FMA with the scale a part. Zero points cost nothing a word:
  sum_k x w = s sum_k x n - s z sum_k x,
the second term accumulated per column from x's sums over each part, subtracted at the store.

Precision: a half2 lane sums up to four products n * x (fp16 roundings, 11 bits), so each row of
x is first scaled by the power of two that brings its absolute max over the program's K range
into [512, 1024) (no sum reaches fp16's 65504, no normal x underflows), undone at the store; the
sums across words and chunks are fp32. Over its own range, not the row: a program with one
128-row chunk would otherwise read all of x's row for the scale of 128 of its values.

Programs: (N tile, K split). A program owns `block_n` columns as a [16, T, SUB] words tile (T =
block_n / SUB), so that Triton gives each thread one of the chunk's 16 rows and its x work (the
loads, scaling and packing of 8 x values) serves all of its columns. Per chunk it reads the
tile (N minor: coalesced; evicted first, so that x, re-read per chunk, stays cached) and the
chunk's scales and zeros. When N / block_n tiles are too few to keep every SM streaming, K is
split into `splits` ranges of whole chunks whose fp32 partial products the wrapper sums
(deterministic, no atomics); a single split writes x's dtype directly. Loads past N read 0 and
every store is masked to the live columns; the static loop covers x's rows and no more.

In interpret mode (the CPU) the inline-PTX blocks run as their jnp twins (`_pack_pairs`,
`_dot8`), with the same roundings; tests/conftest.py's lower_for_h200 checks the PTX lowers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import pipelined_loop, quant_matmul
from pallas_kernels.half2 import pow2_scale, widen
from pallas_kernels.ptx import asm
from pallas_kernels.quant_matmul import CHUNK_ROWS
from pallas_kernels.split_sum import sum_splits
from pallas_kernels.stacked import prefix

_SLICE = 16  # a chunk's rows per nibble: the words tile's rows
# Tiles from the H200 sweep (experiments/gemv_gpu.py): 128 columns at 4 warps, and K cut
# short enough that about _TARGET_PROGRAMS programs stream at once, on each of the 8B's
# projections.
DEFAULT_BLOCK_N = 128
DEFAULT_NUM_WARPS = 4
# words tiles in flight through shared memory (pipelined_loop); 1: each loaded as its chunk comes
DEFAULT_NUM_STAGES = 1
_TARGET_PROGRAMS = 1024
# SUB: Triton fills a warp along N first (4 words a thread), then the rows: 8 columns a warp
# leave one of the 16 rows a thread
_SUB_N_PER_WARP = 8
_X_TOP = 9  # x's rows scaled to an absolute max in [2^9, 2^10): 4 products a half lane < 65504

int4_gemv_reference = quant_matmul.int4_matmul_reference  # the contract


def _load(ref, mask):
    """A streamed read (weights, scales, zeros: used once), 0 where masked off."""
    return pltriton.load(ref, mask=mask, other=0, eviction_policy="evict_first")


# d = half2(hi = a, lo = b)
_PACK_PTX = "cvt.rn.f16x2.f32 $0, $2, $1;"
# $0 <- half2 sums x_j n_j + x_j' n_j' of word $1 for j = 0 | 4 and j' = 1 | 5 (lo | hi), with
# x pairs $2 = (x_j0 | x_j4), $3 = (x_j1 | x_j5); the same PTX on word >> 8 gives j = 2 | 6 and
# j' = 3 | 7. LOP3 0xEA: (a & b) | c; 0x6400: 1024.0, 0x2C00: 1 / 16, 0xD400: -64.0
_DOT4_PTX = """{
.reg .b32 t0, t1, k, c;
lop3.b32 t0, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 t1, $1, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 k, 0x64006400;
sub.rn.f16x2 t0, t0, k;
mov.b32 k, 0x2C002C00;
mov.b32 c, 0xD400D400;
fma.rn.f16x2 t1, t1, k, c;
mul.rn.f16x2 $0, t0, $2;
fma.rn.f16x2 $0, t1, $3, $0;
}"""
# $0 <- half2 $1 + $2
_ADD_PTX = "add.rn.f16x2 $0, $1, $2;"


def _pack_pairs(lo, hi, interpret):
    """lo, hi [16] fp32 -> their fp16 pair: an int32 [16] (half2 bits) on the GPU; in interpret
    mode the two fp16 arrays, as _dot8's twin takes them."""
    if interpret:
        return lo.astype(jnp.float16), hi.astype(jnp.float16)
    return asm(_PACK_PTX, jnp.int32, "=r,f,f", lo, hi)


def _dot8(words, pairs, part_rows, interpret):
    """words [16, T, SUB] int32, pairs: 4 x-pairs [16] (_pack_pairs') -> fp32 [16, T, SUB] sums of
    x_j n_j over each word's rows j of a part: 32-row parts (j in {0, 1}, {2, 3}, {4, 5},
    {6, 7}) for 32-row groups, else 64-row halves (j < 4, j >= 4): two products a half2 lane,
    then the lanes' halves added in half2, rounded as the PTX rounds them."""
    if interpret:
        nib = [((words >> (4 * j)) & 0xF).astype(jnp.float32) for j in range(8)]
        x = [pairs[j % 4][j // 4].astype(jnp.float32)[:, None, None] for j in range(8)]
        half = lambda v: v.astype(jnp.float16).astype(jnp.float32)
        quarters = [half(half(nib[j] * x[j]) + nib[j + 1] * x[j + 1]) for j in (0, 2, 4, 6)]
        if part_rows == 32:
            return quarters
        return [half(quarters[0] + quarters[1]), half(quarters[2] + quarters[3])]
    wide = [jnp.broadcast_to(p[:, None, None], words.shape) for p in pairs]
    a = asm(_DOT4_PTX, jnp.int32, "=r,r,r,r", words, wide[0], wide[1])  # rows 0, 1 | 4, 5
    b = asm(_DOT4_PTX, jnp.int32, "=r,r,r,r", words >> 8, wide[2], wide[3])  # 2, 3 | 6, 7
    if part_rows == 32:
        return [widen(a, "l"), widen(b, "l"), widen(a, "h"), widen(b, "h")]
    ab = asm(_ADD_PTX, jnp.int32, "=r,r,r", a, b)
    return [widen(ab, "l"), widen(ab, "h")]


def _row_scales(x_ref, start, stop, span):
    """Per row of x: the power of two taking the absolute max of its columns [start, stop) (a
    program's K range, at most `span`, a power of two) into [2^_X_TOP, 2^(_X_TOP + 1)); the
    range is all the program's products see, so other programs' columns need not be read."""
    ks = start + jnp.arange(span, dtype=jnp.int32)
    scales = []
    for m in range(x_ref.shape[0]):
        top = jnp.max(jnp.abs(pltriton.load(x_ref.at[m, ks], mask=ks < stop, other=0)
                              .astype(jnp.float32)))
        scales.append(pow2_scale(top, _X_TOP))
    return scales


def _kernel(x_ref, q_ref, s_ref, z_ref, o_ref, *, group, block_n, sub_n, chunks_per_split,
            num_stages, interpret, layer):
    """o_ref [splits, M, N]: this split's x @ w over its chunks, for one N tile held as
    [16, T, SUB] words (T = block_n / SUB), so that Triton gives each thread one of the 16 rows
    and its x work serves 4T columns. The zero points' share, s z sum_k x, accumulates per
    column ([T, SUB], from x's sums over each part), the rest per word; their difference is
    taken once, at the store."""
    num_rows = x_ref.shape[0]
    tiles = block_n // sub_n
    cols = (pl.program_id(0) * block_n + sub_n * jnp.arange(tiles, dtype=jnp.int32)[:, None]
            + jnp.arange(sub_n, dtype=jnp.int32)[None, :])  # [T, SUB]
    col_ok = cols < q_ref.shape[1]
    lanes = jnp.arange(_SLICE, dtype=jnp.int32)
    sum_rows = 32 if group % 64 else 64  # rows of one of _dot8's sums
    sums_per_group = max(1, group // sum_rows) if group < CHUNK_ROWS else CHUNK_ROWS // sum_rows
    split = pl.program_id(1)
    first = split * chunks_per_split
    last = jnp.minimum(first + chunks_per_split, x_ref.shape[1] // CHUNK_ROWS)
    x_scales = _row_scales(x_ref, first * CHUNK_ROWS, last * CHUNK_ROWS,
                           pl.next_power_of_2(chunks_per_split * CHUNK_ROWS))
    s_row, z_row = prefix(s_ref, 2, layer), prefix(z_ref, 2, layer)

    def chunk(c, carry):  # M x ([16, T, SUB] s x n, [T, SUB] s z x) in x's scaled units
        words = _load(q_ref.at[c * _SLICE + lanes[:, None, None], cols[None]], col_ok[None])
        num_groups = CHUNK_ROWS // (sum_rows * sums_per_group)
        groups = [(c * CHUNK_ROWS + g * CHUNK_ROWS // num_groups) // group
                  for g in range(num_groups)]
        s = [_load(s_ref.at[(*s_row, g, cols)], col_ok).astype(jnp.float32) for g in groups]
        sz = [si * _load(z_ref.at[(*z_row, g, cols)], col_ok).astype(jnp.float32)
              for si, g in zip(s, groups)]
        out = []
        for m in range(num_rows):
            xs = [pltriton.load(x_ref.at[m, c * CHUNK_ROWS + j * _SLICE + lanes])
                  .astype(jnp.float32) * x_scales[m] for j in range(8)]
            sums = _dot8(words, [_pack_pairs(xs[j], xs[j + 4], interpret) for j in range(4)],
                         sum_rows, interpret)
            acc, zero = carry[m]
            rows_per_group = 8 // num_groups  # nibbles j a group covers
            for g in range(num_groups):
                part = sum(sums[g * sums_per_group + 1:(g + 1) * sums_per_group],
                           sums[g * sums_per_group])
                xsum = jnp.sum(sum(xs[g * rows_per_group + 1:(g + 1) * rows_per_group],
                                   xs[g * rows_per_group]))
                acc = acc + s[g][None] * part
                zero = zero + sz[g] * xsum
            out.append((acc, zero))
        return tuple(out)

    carry = pipelined_loop.fori_loop(first, last, chunk, tuple(
        (jnp.zeros((_SLICE, tiles, sub_n), jnp.float32), jnp.zeros((tiles, sub_n), jnp.float32))
        for _ in range(num_rows)), num_stages=num_stages)
    for m, (acc, zero) in enumerate(carry):
        pltriton.store(o_ref.at[split, m, cols],
                       ((jnp.sum(acc, axis=0) - zero) / x_scales[m]).astype(o_ref.dtype),
                       mask=col_ok)

def _whole_splits(chunks: int, splits: int) -> int:
    """The fewest splits of the same length: none left empty, none past the chunks."""
    return pl.cdiv(chunks, pl.cdiv(chunks, splits))


def default_splits(n: int, k: int, block_n: int) -> int:
    """K splits bringing the programs to about _TARGET_PROGRAMS (a power of two of them per N
    tile, so that K's chunks divide evenly where they can), made whole: many short K ranges keep
    every SM streaming, where a GEMV's few N tiles alone would leave most idle."""
    chunks = k // CHUNK_ROWS
    splits = pl.next_power_of_2(pl.cdiv(_TARGET_PROGRAMS, pl.cdiv(n, block_n)))
    return _whole_splits(chunks, min(splits, chunks))


@functools.partial(jax.jit, static_argnames=("layer", "block_n", "splits", "num_warps",
                                             "num_stages", "interpret"))
def int4_gemv(x: jax.Array, qweight: jax.Array, scales: jax.Array, zeros: jax.Array, *,
              layer: int | None = None, block_n: int | None = None, splits: int | None = None,
              num_warps: int = DEFAULT_NUM_WARPS, num_stages: int = DEFAULT_NUM_STAGES,
              interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel; `int4_gemv_reference`'s contract. block_n: columns a program
    (a power of two, at least 16; default DEFAULT_BLOCK_N); splits: K ranges (default
    default_splits, a count leaving a range empty lowered to the fewest of the same length);
    num_warps: Triton's; num_stages: the words tiles in flight through shared memory
    (pipelined_loop; 1: each loaded into registers when its chunk comes). layer: the row of
    stacked scales and zeros."""
    group = quant_matmul._check(x, qweight, scales, zeros, layer)
    if group not in (32, 64) and group % CHUNK_ROWS:
        raise ValueError(f"group size {group}: 32, 64 or a multiple of {CHUNK_ROWS}")
    (m, k), n = x.shape, qweight.shape[1]
    block_n = min(block_n or DEFAULT_BLOCK_N, max(_SLICE, pl.next_power_of_2(n)))
    if block_n & (block_n - 1) or block_n < _SLICE or (splits is not None and splits < 1):
        raise ValueError(f"block_n {block_n}: a power of two, at least {_SLICE}; splits "
                         f"{splits}: at least 1")
    chunks = k // CHUNK_ROWS
    splits = _whole_splits(chunks, splits or default_splits(n, k, block_n))
    out = pl.pallas_call(
        functools.partial(_kernel, group=group, block_n=block_n,
                          sub_n=min(block_n, _SUB_N_PER_WARP * num_warps),
                          chunks_per_split=pl.cdiv(chunks, splits), num_stages=num_stages,
                          interpret=interpret, layer=layer),
        grid=(pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="int4_gemv",
    )(x, qweight, scales, zeros)
    return out[0] if splits == 1 else sum_splits(out).astype(x.dtype)
