"""FP8 weight-only matmul (W8A16) for few tokens: x [M, K] (16-bit or fp32) times a
float8_e4m3fn matrix with one scale per output channel, the weights upcast to x's dtype inside
the K loop.

  values [N, K] float8_e4m3fn   K minor, as models/quant.py's Fp8Weight keeps them
  scale  [N] float32
  y[m, n] = sum_k x[m, k] * values[n, k] * scale[n]

At decode (a few rows) the product is a stream over the weights: 1 byte a weight read, none
written, x never quantised. The upcast is exact (every e4m3 value is a bf16, fp16 and fp32
value), so the products are the reference's; only the fp32 sums' order differs.

Programs: (M tile, N tile, K split), K split as the int4 kernel's (quant_matmul.num_k_splits)
when the M x N tiles are too few to stream the weights; the fp32 partial products, each already
scaled per channel, are summed by the wrapper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.quant_matmul import num_k_splits

FP8 = jnp.float8_e4m3fn
_BLOCK_K = 128  # 128 bytes of each weight row a step


def fp8_matmul_reference(x, values, scale) -> jax.Array:
    """x [M, K] @ (values [N, K] * scale [N, 1]).T -> [M, N] in x's dtype (fp32 sums)."""
    y = jnp.einsum("mk,nk->mn", x, values.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, block_m, block_n, steps_per_split):
    """o_ref [splits, M, N]: this split's scaled x @ w.T over its K range, one [BM, BN] tile."""
    m_total, k_total = x_ref.shape
    n_total = w_ref.shape[0]
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m_total, cols < n_total

    def step(i, acc):
        ks = i * _BLOCK_K + jnp.arange(_BLOCK_K, dtype=jnp.int32)
        x_mask, w_mask = row_ok[:, None], col_ok[:, None]
        if k_total % _BLOCK_K:  # masked only when ragged: a mask along K breaks vector loads
            x_mask, w_mask = x_mask & (ks < k_total)[None, :], w_mask & (ks < k_total)[None, :]
        x = pltriton.load(x_ref.at[rows[:, None], ks[None, :]], mask=x_mask, other=0.0)  # [BM, BK]
        w = pltriton.load(w_ref.at[cols[:, None], ks[None, :]], mask=w_mask, other=0.0)  # [BN, BK]
        # fp32 models get fp32 products, as the reference (no TF32)
        return acc + pltriton.dot(x, w.astype(x.dtype), trans_b=True, allow_tf32=False)

    split = pl.program_id(2)
    first = split * steps_per_split
    last = jnp.minimum(first + steps_per_split, pl.cdiv(k_total, _BLOCK_K))
    acc = jax.lax.fori_loop(first, last, step, jnp.zeros((block_m, block_n), jnp.float32))
    scale = pltriton.load(s_ref.at[cols], mask=col_ok, other=0)
    pltriton.store(o_ref.at[split, rows[:, None], cols[None, :]],
                   (acc * scale[None, :]).astype(o_ref.dtype),
                   mask=row_ok[:, None] & col_ok[None, :])


def _check(x, values, scale) -> None:
    (_, k), (n, w_k) = x.shape, values.shape
    if values.dtype != FP8 or w_k != k or scale.shape != (n,):
        raise ValueError(f"x {x.shape}, values {values.shape} {values.dtype}, scale "
                         f"{scale.shape}: need x [M, K], values [N, K] float8_e4m3fn, scale [N]")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "num_warps", "splits",
                                             "interpret"))
def fp8_matmul(x, values, scale, *, block_m: int | None = None, block_n: int = 64,
               num_warps: int = 4, splits: int | None = None,
               interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel; same contract as `fp8_matmul_reference`. One program: a
    [block_m, block_n] output tile over one K split, 128 columns of K a step. splits: K
    splits (default quant_matmul.num_k_splits)."""
    _check(x, values, scale)
    (m, k), n = x.shape, values.shape[0]
    block_m = block_m or (16 if m <= 16 else 64)
    splits = splits or num_k_splits(m, k, n, block_m, block_n, _BLOCK_K)
    steps_per_split = pl.cdiv(pl.cdiv(k, _BLOCK_K), splits)
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n,
                               steps_per_split=steps_per_split)
    out = pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), pl.cdiv(n, block_n), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), x.dtype if splits == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret, name="fp8_matmul",
    )(x, values, scale.astype(jnp.float32))
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
