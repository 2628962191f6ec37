"""A candidate W8A16 FP8 GEMV with fewer instructions a weight: float8 pairs widened to packed
half2 in one instruction and multiplied by x in half2 (inline PTX), the half2 sums widened to
fp32 every few K tiles. Not the product's kernel until an H200 run times it
(`gemv_gpu.py --weights fp8` times it as `fp8_half2`); `pallas_kernels/fp8_gemv.py` has the contract and
the reference.

Why: the product's GEMV widens each weight to fp32 (a conversion to half2 a pair, then one to
fp32 a weight) and spends an fp32 FMA on it, ~4.8 instructions a weight in all, and streams at
about half of what that issue rate allows (docs/lab/2026-12-02-session20.md). Here a 32-bit word
(four weights along K) costs two `cvt.rn.f16x2.e4m3x2` and two half2 FMAs into a half2
accumulator, whose two lanes are widened and added to fp32 once per _TILES_PER_WIDEN tiles.

Layout: the [N, K] float8 matrix is read as [N, K / 4] int32 words (a bitcast in the wrapper);
a program owns block_n channels and walks K in block_k tiles of [block_n, G, 4] words (four
words, 16 bytes, a thread), as the product kernel's [block_n, G, 16] bytes.

Precision: each half2 lane sums 2 * _TILES_PER_WIDEN products w * x (one fp16 rounding each),
so x's rows are scaled by a power of two into [2^_X_TOP, 2^(_X_TOP + 1)) first: no lane passes
fp16's 65504 (|w| <= 448), no normal x underflows; undone at the store. The wrapper does that
and packs x's fp16 pairs as words (XLA ops on K values a row), so the kernel loads x as it loads
the weights, word for word, with no conversion in the loop.

In interpret mode (the CPU) the inline PTX runs as its jnp twin (`_fma4`, same roundings); the
PTX itself is checked on the GPU against the reference before it is timed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.fp8_gemv import DEFAULT_TILE, FP8, default_splits
from pallas_kernels.half2 import asm, pow2_scale, widen

_WORDS = 4  # int32 words a thread loads at once: 16 float8 values
_TILES_PER_WIDEN = 4
_X_TOP = 3  # 2 * 4 products of |w| <= 448 and |x| < 16 a lane: under 65504

# $0 <- $4 + (w0 | w1) * $2 + (w2 | w3) * $3 in half2, w0..w3 the float8 bytes of word $1
_FMA4_PTX = """{
.reg .b16 lo, hi;
.reg .b32 a, b;
mov.b32 {lo, hi}, $1;
cvt.rn.f16x2.e4m3x2 a, lo;
cvt.rn.f16x2.e4m3x2 b, hi;
fma.rn.f16x2 $0, a, $2, $4;
fma.rn.f16x2 $0, b, $3, $0;
}"""


def _half(v):
    return v.astype(jnp.float16).astype(jnp.float32)


def _fma4(words, x01, x23, acc, interpret):
    """acc + the words' four float8 values times x's, in half2: acc, x01, x23 half2 (interpret:
    (lo, hi) pairs of fp16-valued fp32 arrays); words [Bn, G, 4] int32."""
    if interpret:
        w = [jax.lax.bitcast_convert_type(((words >> (8 * i)) & 0xFF).astype(jnp.uint8), FP8)
             .astype(jnp.float32) for i in range(4)]
        lo = _half(w[2] * x23[0] + _half(w[0] * x01[0] + acc[0]))
        hi = _half(w[3] * x23[1] + _half(w[1] * x01[1] + acc[1]))
        return lo, hi
    x01, x23 = (jnp.broadcast_to(p, words.shape) for p in (x01, x23))
    return asm(_FMA4_PTX, jnp.int32, "=r,r,r,r,r", words, x01, x23, acc)


def _widened(acc, interpret):
    """A half2 accumulator's two lanes summed in fp32."""
    if interpret:
        return acc[0] + acc[1]
    return widen(acc, "l") + widen(acc, "h")


def _x_pairs(x):
    """x [M, K] -> (its rows scaled by powers of two into [2^_X_TOP, 2^(_X_TOP + 1)) as fp16
    pairs: (k, k + 1) | (k + 2, k + 3) for each word's k, int32 [M, K / 4] each (half2 bits), and
    the row scales [M, 1] fp32). A few XLA ops on K values a row, before the kernel."""
    x32 = x.astype(jnp.float32)
    top = jnp.max(jnp.abs(x32), axis=1, keepdims=True)
    scales = pow2_scale(top, _X_TOP)
    halves = (x32 * scales).astype(jnp.float16).reshape(x.shape[0], -1, 2, 2)
    pairs = jax.lax.bitcast_convert_type(halves, jnp.int32)  # [M, K / 4, 2]
    return pairs[..., 0], pairs[..., 1], scales


def _kernel(x01_ref, x23_ref, xs_ref, w_ref, s_ref, o_ref, *, block_n, block_k, steps_per_split,
            interpret):
    """o_ref [splits, M, N]: this split's scaled x @ values.T for one N tile; x01, x23 [M, K / 4]
    (_x_pairs'), xs [M, 1] its row scales."""
    num_rows, words_total = x01_ref.shape
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < w_ref.shape[0]
    split = pl.program_id(1)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, pl.cdiv(4 * words_total, block_k))
    groups = block_k // (4 * _WORDS)
    lanes = (jnp.arange(groups, dtype=jnp.int32)[:, None] * _WORDS
             + jnp.arange(_WORDS, dtype=jnp.int32)[None, :])  # [G, 4] words of a tile
    zero = (lambda: (jnp.zeros((block_n, groups, _WORDS), jnp.float32),) * 2) if interpret \
        else (lambda: jnp.zeros((block_n, groups, _WORDS), jnp.int32))

    def x_pair(ref, m, idx, ok):
        pair = pltriton.load(ref.at[m, idx], mask=ok, other=0)  # [G, 4] half2 bits
        if interpret:  # the twin's (lo, hi) fp16 values
            halves = jax.lax.bitcast_convert_type(pair, jnp.float16)
            pair = (halves[..., 0].astype(jnp.float32), halves[..., 1].astype(jnp.float32))
        return jax.tree.map(lambda p: p[None], pair)

    def tile(s, accs):  # one K tile into the half2 accumulators
        idx = s * (block_k // 4) + lanes
        ok = (idx < words_total) & (s < last)
        words = pltriton.load(w_ref.at[cols[:, None, None], idx[None]],
                              mask=col_ok[:, None, None] & ok[None], other=0,
                              eviction_policy="evict_first")  # [Bn, G, 4]
        return [_fma4(words, x_pair(x01_ref, m, idx, ok), x_pair(x23_ref, m, idx, ok), accs[m],
                      interpret) for m in range(num_rows)]

    def widen_group(t, accs):  # _TILES_PER_WIDEN tiles in half2, then into fp32
        halves = [zero() for _ in range(num_rows)]
        for i in range(_TILES_PER_WIDEN):
            halves = tile(first + t * _TILES_PER_WIDEN + i, halves)
        return tuple(a + _widened(h, interpret) for a, h in zip(accs, halves))

    accs = jax.lax.fori_loop(0, pl.cdiv(last - first, _TILES_PER_WIDEN), widen_group, tuple(
        jnp.zeros((block_n, groups, _WORDS), jnp.float32) for _ in range(num_rows)))
    scale = pltriton.load(s_ref.at[cols], mask=col_ok, other=0)
    for m in range(num_rows):
        y = jnp.sum(jnp.sum(accs[m], axis=2), axis=1) * scale / xs_ref[m, 0]
        pltriton.store(o_ref.at[split, m, cols], y.astype(o_ref.dtype), mask=col_ok)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages",
                                             "splits", "interpret"))
def fp8_gemv_half2(x: jax.Array, values: jax.Array, scale: jax.Array, *,
                   block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
                   num_stages: int = 3, splits: int | None = None,
                   interpret: bool = False) -> jax.Array:
    """fp8_gemv's contract (no norm prologue) and tiling arguments; K a multiple of 4."""
    (m, k), (n, k_values) = x.shape, values.shape
    if k != k_values or scale.shape != (n,) or values.dtype != FP8 or k % 4:
        raise ValueError(f"x {x.shape}, values {values.shape} {values.dtype}, scale "
                         f"{scale.shape}: want [M, K], [N, K] float8_e4m3fn, [N], K % 4 == 0")
    block_n = min(block_n or DEFAULT_TILE[0], max(16, pl.next_power_of_2(n)))
    block_k = min(block_k or DEFAULT_TILE[1], max(16, pl.next_power_of_2(k)))
    splits = splits or default_splits(n, k, block_n, block_k)
    words = jax.lax.bitcast_convert_type(values.reshape(n, k // 4, 4), jnp.int32)
    out = pl.pallas_call(
        functools.partial(_kernel, block_n=block_n, block_k=block_k,
                          steps_per_split=pl.cdiv(pl.cdiv(k, block_k), splits),
                          interpret=interpret),
        grid=(pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="fp8_gemv_half2",
    )(*_x_pairs(x), words, scale.astype(jnp.float32))
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
