"""W8A16 GEMV: a few rows of x (decode's tokens) times an FP8 matrix with one scale per output
channel, the weights widened in registers and x never quantised.

  x      [M, K]  bf16, f16 or f32; M small (a decode step's tokens)
  values [N, K]  float8_e4m3fn, K minor (quant.Fp8Weight's layout, its output axes flattened)
  scale  [N]     fp32, per output channel
  ->     [M, N]  in x's dtype: y[m, n] = scale[n] * sum_k x[m, k] * values[n, k], fp32 math
  norm_weight [K] (optional, x's dtype): x is first RMS-normalised (`rms_norm_reference`, a
                 decoder's input norm), so the norm costs no kernel of its own

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

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

FP8 = jnp.float8_e4m3fn
_VECTOR = 16  # fp8 values one thread loads at once (16 bytes)
DEFAULT_TILE = (32, 256)  # (block_n, block_k): 64 fp8 bytes a thread at 4 warps
_TARGET_PROGRAMS = 528  # about four per SM on an H200 (132 SMs)
_MIN_STEPS_PER_SPLIT = 4  # K tiles per split: shorter loops spend their time in set-up
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., H]: normalised in fp32, cast back before the weight (as HF's LlamaRMSNorm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def fp8_gemv_reference(x: jax.Array, values: jax.Array, scale: jax.Array,
                       norm_weight: jax.Array | None = None, eps: float = 1e-6) -> jax.Array:
    """The module's contract in jnp: x [M, K] (RMS-normalised first, given norm_weight) @
    values [N, K].T * scale [N] -> [M, N] in x's dtype, every product and sum in fp32."""
    if norm_weight is not None:
        x = rms_norm_reference(x, norm_weight, eps)
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


def _norm_factors(x_ref, eps):
    """RMSNorm's rsqrt(mean(x[m]^2) + eps) per row of x, fp32, from x's whole rows."""
    k_total = x_ref.shape[1]
    ks = jnp.arange(pl.next_power_of_2(k_total), dtype=jnp.int32)
    factors = []
    for m in range(x_ref.shape[0]):
        xm = pltriton.load(x_ref.at[m, ks], mask=ks < k_total, other=0).astype(jnp.float32)
        factors.append(jax.lax.rsqrt(jnp.sum(xm * xm) / k_total + eps))
    return factors


def _fma_kernel(x_ref, v_ref, s_ref, *refs, block_n, block_k, steps_per_split, eps):
    """o_ref [splits, M, N]: this split's scaled x @ values.T for one N tile, on the CUDA cores.
    refs: (norm_weight [K], o_ref) with a norm (eps not None), else (o_ref,)."""
    *norm_ref, o_ref = refs
    num_rows, k_total = x_ref.shape
    cols, col_ok, split, first, last = _tiles(v_ref, block_n, block_k, steps_per_split)
    groups = block_k // _VECTOR
    lanes = (jnp.arange(groups, dtype=jnp.int32)[:, None] * _VECTOR
             + jnp.arange(_VECTOR, dtype=jnp.int32)[None, :])  # [G, 16]
    factors = _norm_factors(x_ref, eps) if norm_ref else None

    def x_tile(m, ks, k_ok):  # x[m, ks] (normalised, with a norm) as fp32
        xm = pltriton.load(x_ref.at[m, ks], mask=k_ok, other=0)
        if factors is not None:  # the unfused norm's two roundings to x's dtype
            xm = (xm.astype(jnp.float32) * factors[m]).astype(xm.dtype)
            weight = pltriton.load(norm_ref[0].at[ks], mask=k_ok, other=0)
            xm = (weight.astype(jnp.float32) * xm.astype(jnp.float32)).astype(xm.dtype)
        return xm.astype(jnp.float32)

    def step(s, acc):  # acc: M x [Bn, G]
        ks = s * block_k + lanes
        k_ok = ks < k_total
        w = _weights(v_ref, cols, col_ok, ks, k_ok).astype(jnp.float32)  # [Bn, G, 16]
        return tuple(acc[m] + jnp.sum(w * x_tile(m, ks, k_ok)[None], axis=2)
                     for m in range(num_rows))

    acc = jax.lax.fori_loop(first, last, step, tuple(
        jnp.zeros((block_n, groups), jnp.float32) for _ in range(num_rows)))
    scale = pltriton.load(s_ref.at[cols], mask=col_ok, other=0)
    for m in range(num_rows):
        pltriton.store(o_ref.at[split, m, cols],
                       (jnp.sum(acc[m], axis=1) * scale).astype(o_ref.dtype), mask=col_ok)


def default_splits(n: int, k: int, block_n: int, block_k: int) -> int:
    """K splits that bring the programs to about _TARGET_PROGRAMS, each at least
    _MIN_STEPS_PER_SPLIT tiles long; 1 when the N tiles alone suffice (a gate/up projection)."""
    steps = pl.cdiv(k, block_k)
    splits = max(1, min(steps // _MIN_STEPS_PER_SPLIT, _TARGET_PROGRAMS // pl.cdiv(n, block_n)))
    return pl.cdiv(steps, pl.cdiv(steps, splits))  # no split left empty


@functools.partial(jax.jit, static_argnames=("eps", "block_n", "block_k", "num_warps",
                                             "num_stages", "splits", "interpret"))
def fp8_gemv(x: jax.Array, values: jax.Array, scale: jax.Array,
             norm_weight: jax.Array | None = None, *, eps: float = 1e-6,
             block_n: int | None = None, block_k: int | None = None, num_warps: int = 4,
             num_stages: int = 3, splits: int | None = None,
             interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel; `fp8_gemv_reference`'s contract. block_n (channels a
    program) and block_k (the K tile) are powers of two; num_stages: the K loop's pipeline
    depth; splits: K ranges. Defaults: DEFAULT_TILE, default_splits."""
    (m, k), (n, k_values) = x.shape, values.shape
    if k != k_values or scale.shape != (n,) or values.dtype != FP8:
        raise ValueError(f"x {x.shape}, values {values.shape} {values.dtype}, scale "
                         f"{scale.shape}: want [M, K], [N, K] float8_e4m3fn, [N]")
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight {norm_weight.shape} {norm_weight.dtype}: want [{k}] "
                         f"{x.dtype}, x's dtype")
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
    out = pl.pallas_call(
        functools.partial(_fma_kernel, block_n=block_n, block_k=block_k,
                          steps_per_split=pl.cdiv(pl.cdiv(k, block_k), splits),
                          eps=eps if norm else None),
        grid=(pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="fp8_gemv",
    )(x, values, scale.astype(jnp.float32), *norm)
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
