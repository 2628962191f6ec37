"""W8A16 GEMV: a few rows of x (decode's tokens) times an FP8 matrix with one scale per output
channel, the weights widened in registers and x never quantised.

  x      [M, K]  bf16, f16 or f32; M small (a decode step's tokens)
  values [N, K]  float8_e4m3fn, K minor (quant.Fp8Weight's layout, its output axes flattened)
  scale  [N]     fp32, per output channel
  ->     [M, N]  in x's dtype: y[m, n] = scale[n] * sum_k x[m, k] * values[n, k], fp32 math
  norm_weight [K] (optional, x's dtype): x is first RMS-normalised (`rms_norm_reference`, a
                 decoder's input norm), so the norm costs no kernel of its own: x times the
                 norm's weight is rounded to x's dtype once and the RMS divides the fp32 sum
                 (the reference rounds twice, as HF's norm)
  scale and norm_weight may also come stacked across layers, [L, N] and [L, K] (stacked.py),
  read at row `layer`
  swiglu (instead of a norm): x is [M, 2K], a gate/up product (gate columns, then up), and the
  GEMV's operand is silu(gate) * up, taken as the loop reads x (rounded to x's dtype once), so
  SwiGLU costs no kernel of its own (a decoder's down projection)

With few rows the product is a weight read: each weight is used M times, so the work is to
stream `values` at HBM bandwidth and to spend few instructions per weight byte.

Programs: (N tile, K split). A program owns `block_n` output channels and one range of K, which
it walks in [block_n, block_k] weight tiles (K contiguous in memory: each thread loads 16 fp8
bytes of one channel, a warp whole rows of the tile), loaded evict-first (streamed once) so that
x's rows, re-read per tile (M * K elements, small beside the weights), stay cached. The tile, as
[block_n, block_k / 16, 16] (one thread's 16 bytes a group), is widened to fp32 once and, for
each row m of x (a static loop), multiplied by x[m]'s slice and summed over its groups' 16
lanes, all within the thread; the sums over groups wait for the loop's end (no shuffle per
tile). M FMAs per weight, on the CUDA cores: a kernel for one row (decode at batch 1). With
more rows the tensor cores (cuBLAS's W8A8 GEMM) are faster (benchmarks/quant_linear_gpu.py),
and a dot with x as a 16-row operand was slower than cuBLAS too.

When N / block_n tiles are too few to keep every SM streaming (an o projection: N = 4096), K is
split into `splits` ranges whose fp32 partial products the wrapper sums (deterministic, no
atomics); a single split writes x's dtype directly. Loads past N or K read 0, and so do rows of
x past M; every store is masked to the live rows and channels.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import pipelined_loop
from pallas_kernels.fp8_quant import rms_norm_reference
from pallas_kernels.silu_mul_fp8 import silu_mul
from pallas_kernels.split_sum import sum_splits
from pallas_kernels.stacked import check_stacked, prefix

FP8 = jnp.float8_e4m3fn
_VECTOR = 16  # fp8 values one thread loads at once (16 bytes)
DEFAULT_TILE = (32, 256)  # (block_n, block_k): 64 fp8 bytes a thread at 4 warps
# weight tiles in flight through shared memory (pipelined_loop); 1: each loaded as its step comes
DEFAULT_NUM_STAGES = 1
_TARGET_PROGRAMS = 528  # about four per SM on an H200 (132 SMs)
_MIN_STEPS_PER_SPLIT = 4  # K tiles per split: shorter loops spend their time in set-up
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def fp8_gemv_reference(x: jax.Array, values: jax.Array, scale: jax.Array,
                       norm_weight: jax.Array | None = None, eps: float = 1e-6,
                       swiglu: bool = False) -> jax.Array:
    """The module's contract in jnp: x [M, K] (RMS-normalised first, given norm_weight; with
    swiglu x [M, 2K] -> silu(gate) * up, as a decoder's MLP takes it) @ values [N, K].T *
    scale [N] -> [M, N] in x's dtype, every product and sum in fp32."""
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
    if swiglu:
        gate, up = jnp.split(x, 2, axis=1)
        x = jax.nn.silu(gate) * up
    y = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), values.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _tiles(v_ref, block_n, block_k, steps_per_split):
    """This program's channels [Bn], their mask, its split and K-tile range [first, last)."""
    cols = pl.program_id(0) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    split = pl.program_id(1)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, pl.cdiv(v_ref.shape[1], block_k))
    return cols, cols < v_ref.shape[0], split, first, last


def _weights(v_ref, cols, col_ok, ks, k_ok):
    """The fp8 tile values[cols, ks] (cols [Bn], ks [...] broadcast behind it), 0 past N and K;
    evicted first: read once, it must not push x out of the caches."""
    expand = (slice(None),) + (None,) * ks.ndim
    return pltriton.load(v_ref.at[cols[expand], ks[None]], mask=col_ok[expand] & k_ok[None],
                         other=0.0, eviction_policy="evict_first")


def _fma_kernel(x_ref, v_ref, s_ref, *refs, block_n, block_k, steps_per_split, num_stages,
                eps, layer, swiglu, interpret):
    """o_ref [splits, M, N]: this split's scaled x @ values.T for one N tile, on the CUDA cores.
    refs: (o_ref,), or with a norm (eps not None) (norm_weight [K], o_ref), then sumsq_ref
    [splits, M] when K is split. With a norm the loop multiplies x by the norm's weight and
    sums x^2 over the split's K range as it goes: one split divides by the RMS itself, several
    leave their sums to the wrapper (no program reads x's whole row up front). x * weight (and
    silu(gate) * up with swiglu) is rounded to x's dtype before it changes layout, and the sums
    of squares are summed over each thread's lanes as they come: registers an SM can hold for
    as many programs as without them (an 8B's gate/up GEMV fits one wave)."""
    norm_ref, (o_ref, *sumsq_ref) = (None, refs) if eps is None else (refs[0], refs[1:])
    sumsq_ref = sumsq_ref[0] if sumsq_ref else None
    num_rows, k_total = x_ref.shape[0], v_ref.shape[1]
    norm_row = None if norm_ref is None else prefix(norm_ref, 1, layer)
    cols, col_ok, split, first, last = _tiles(v_ref, block_n, block_k, steps_per_split)
    groups = block_k // _VECTOR
    lanes = (jnp.arange(groups, dtype=jnp.int32)[:, None] * _VECTOR
             + jnp.arange(_VECTOR, dtype=jnp.int32)[None, :])  # [G, 16]

    def step(s, carry):  # acc: M x [Bn, G]; sumsq: M x [G] with a norm, else ()
        acc, sumsq = carry
        ks = s * block_k + lanes
        k_ok = ks < k_total
        w = _weights(v_ref, cols, col_ok, ks, k_ok).astype(jnp.float32)  # [Bn, G, 16]
        xs = [pltriton.load(x_ref.at[m, ks], mask=k_ok, other=0) for m in range(num_rows)]
        if swiglu:  # xs are the gates; 0 past K, where silu(0) * 0 = 0
            ups = [pltriton.load(x_ref.at[m, ks + k_total], mask=k_ok, other=0)
                   for m in range(num_rows)]
            xs = [silu_mul(g, u, interpret).astype(g.dtype) for g, u in zip(xs, ups)]
        if norm_ref is not None:
            # over each thread's 16 lanes as they come: a [G, 16] carry holds more registers
            sumsq = tuple(q + jnp.sum(jnp.square(x.astype(jnp.float32)), axis=1)
                          for q, x in zip(sumsq, xs))
            weight = pltriton.load(norm_ref.at[(*norm_row, ks)], mask=k_ok,
                                   other=0).astype(jnp.float32)
            xs = [(x.astype(jnp.float32) * weight).astype(x.dtype) for x in xs]
        return tuple(a + jnp.sum(w * x.astype(jnp.float32)[None], axis=2)
                     for a, x in zip(acc, xs)), sumsq

    def per_row_zeros(shape):
        return tuple(jnp.zeros(shape, jnp.float32) for _ in range(num_rows))

    acc, sumsq = pipelined_loop.fori_loop(first, last, step, (
        per_row_zeros((block_n, groups)),
        per_row_zeros((groups,)) if norm_ref is not None else ()), num_stages=num_stages)
    scale = pltriton.load(s_ref.at[(*prefix(s_ref, 1, layer), cols)], mask=col_ok, other=0)
    for m in range(num_rows):
        y = jnp.sum(acc[m], axis=1) * scale
        if norm_ref is not None and sumsq_ref is None:  # one split: x's whole row was seen
            y = y * jax.lax.rsqrt(jnp.sum(sumsq[m]) / k_total + eps)
        pltriton.store(o_ref.at[split, m, cols], y.astype(o_ref.dtype), mask=col_ok)
    if sumsq_ref is not None:  # every N tile of a split sums the same x: its first stores

        @pl.when(pl.program_id(0) == 0)
        def _():
            for m in range(num_rows):
                pltriton.store(sumsq_ref.at[split, jnp.int32(m)], jnp.sum(sumsq[m]))


def default_splits(n: int, k: int, block_n: int, block_k: int) -> int:
    """K splits that bring the programs to about _TARGET_PROGRAMS, each at least
    _MIN_STEPS_PER_SPLIT tiles long; 1 when the N tiles alone suffice (a gate/up projection)."""
    steps = pl.cdiv(k, block_k)
    splits = max(1, min(steps // _MIN_STEPS_PER_SPLIT, _TARGET_PROGRAMS // pl.cdiv(n, block_n)))
    return pl.cdiv(steps, pl.cdiv(steps, splits))  # no split left empty


class Splits(NamedTuple):
    """A K-split call's output before the wrapper's end (`finish_splits`): the splits' fp32
    products [S, M, N] and, with a norm, their sums of x^2 [S, M] (else None)."""
    parts: jax.Array
    sumsq: jax.Array | None


def finish_splits(splits: Splits, k: int, eps: float, dtype) -> jax.Array:
    """[M, N] in dtype: the parts summed in split order, times the RMS of x's rows over K
    (with a norm)."""
    y = sum_splits(splits.parts)
    if splits.sumsq is not None:
        y = y * jax.lax.rsqrt(sum_splits(splits.sumsq) / k + eps)[:, None]
    return y.astype(dtype)


@functools.partial(jax.jit, static_argnames=("eps", "layer", "swiglu", "block_n", "block_k",
                                             "num_warps", "num_stages", "splits", "keep_splits",
                                             "interpret"))
def fp8_gemv(x: jax.Array, values: jax.Array, scale: jax.Array,
             norm_weight: jax.Array | None = None, *, eps: float = 1e-6,
             layer: int | None = None, swiglu: bool = False, block_n: int | None = None,
             block_k: int | None = None, num_warps: int = 4,
             num_stages: int = DEFAULT_NUM_STAGES,
             splits: int | None = None, keep_splits: bool = False,
             interpret: bool = False) -> jax.Array | Splits:
    """The Pallas (Triton) kernel; `fp8_gemv_reference`'s contract. block_n (channels a
    program) and block_k (the K tile) are powers of two; num_stages: the weight tiles in flight
    through shared memory (pipelined_loop; 1: each loaded into registers when its step comes);
    splits: K ranges. Defaults: DEFAULT_TILE, default_splits. layer: the row of a
    stacked scale or norm_weight; swiglu: x [M, 2K] is a gate/up product (no norm then).
    keep_splits: a K-split call returns its Splits, for a consumer kernel to finish."""
    (m, x_width), (n, k) = x.shape, values.shape
    if x_width != (2 * k if swiglu else k) or values.dtype != FP8:
        raise ValueError(f"x {x.shape}, values {values.shape} {values.dtype}: want [M, "
                         f"{'2K' if swiglu else 'K'}], [N, K] float8_e4m3fn")
    if swiglu and norm_weight is not None:
        raise ValueError("swiglu takes no norm_weight: a norm precedes no down projection")
    check_stacked("scale", scale, (n,), layer)
    if norm_weight is not None:
        check_stacked("norm_weight", norm_weight, (k,), layer)
        if norm_weight.dtype != x.dtype:
            raise ValueError(f"norm_weight {norm_weight.dtype}: want x's dtype {x.dtype}")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"x's dtype {x.dtype}: bfloat16, float16 or float32")
    # the loop takes whole 16-byte groups
    block_n = min(block_n or DEFAULT_TILE[0], max(16, pl.next_power_of_2(n)))
    block_k = min(block_k or DEFAULT_TILE[1], max(_VECTOR, pl.next_power_of_2(k)))
    if any(b & (b - 1) for b in (block_n, block_k)) or block_k < _VECTOR:
        raise ValueError(f"block_n {block_n}, block_k {block_k}: powers of two, block_k "
                         f">= {_VECTOR}")
    splits = splits or default_splits(n, k, block_n, block_k)
    norm = () if norm_weight is None else (norm_weight,)
    out_shape = [jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32)]
    if norm and splits > 1:
        out_shape.append(jax.ShapeDtypeStruct((splits, m), jnp.float32))  # sums of x^2
    out = pl.pallas_call(
        functools.partial(_fma_kernel, block_n=block_n, block_k=block_k,
                          steps_per_split=pl.cdiv(pl.cdiv(k, block_k), splits),
                          num_stages=num_stages, eps=eps if norm else None, layer=layer,
                          swiglu=swiglu, interpret=interpret),
        grid=(pl.cdiv(n, block_n), splits),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="fp8_gemv",
    )(x, values, scale.astype(jnp.float32), *norm)
    if splits == 1:
        return out[0][0]
    parts = Splits(out[0], out[1] if norm else None)
    return parts if keep_splits else finish_splits(parts, k, eps, x.dtype)
