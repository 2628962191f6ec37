"""Fused residual add + LayerNorm, as BERT-family encoders run it after attention and after the
MLP: out = LayerNorm(x + residual) over the last axis, statistics in fp32, out in x's dtype.

XLA spends two fusions on it (the row statistics, then the normalisation, each reading x and the
residual); this is one pass: read x and residual, write out, the bandwidth floor.

Design. One Triton program per block of `block_rows` rows, each row whole in registers: H (384,
768, 1024 in the BERT family) is padded to a power of two inside the tile, the extra lanes masked
on load and store and zeroed before the variance; rows past T are masked too, so T need not be a
multiple of the block. The sum x + residual is taken in fp32: the models' `x + h` is in x's
dtype, but XLA's fusion keeps it in fp32 or not by dtype and backend (excess precision, its
default: on the CPU a bf16 sum stays fp32, an fp16 one is rounded), so its rounding is no fixed
part of their semantics; fp32 is the most accurate and the same in interpret mode as on the GPU.
Then a two-pass mean and variance (the mean, then the mean of squared deviations) on the row in
registers: a one-pass E[x^2] - mean^2 loses the variance of rows whose mean is large against
their spread, and the second pass costs no memory traffic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_TILE_ELEMENTS = 4096  # default block_rows * padded H: 4 rows of BERT-base, 8 of MiniLM


def layer_norm_reference(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float,
                         dtype=None) -> jax.Array:
    """x [..., H], weight, bias [H] -> LayerNorm over the last axis, computed in fp32, in dtype
    (default x's)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    out = (x32 - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)
    return (out + bias.astype(jnp.float32)).astype(dtype or x.dtype)


def add_layer_norm_reference(x: jax.Array, residual: jax.Array, weight: jax.Array,
                             bias: jax.Array, eps: float) -> jax.Array:
    """x, residual [..., H], weight, bias [H] -> [..., H] in x's dtype: layer_norm_reference of
    x + residual, the sum taken in fp32 (see the module's docstring)."""
    return layer_norm_reference(x.astype(jnp.float32) + residual.astype(jnp.float32), weight,
                                bias, eps, x.dtype)


def _kernel(x_ref, r_ref, w_ref, b_ref, out_ref, *, eps, block_rows, block_h):
    """x_ref, r_ref, out_ref [T, H]; w_ref, b_ref [H]: out rows of this program's block."""
    num_rows, hidden = x_ref.shape
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # [Br]
    cols = jnp.arange(block_h, dtype=jnp.int32)  # [Bh]
    col_ok = cols < hidden
    mask = (rows < num_rows)[:, None] & col_ok[None, :]  # [Br, Bh]
    tile = (rows[:, None], cols[None, :])
    x = pltriton.load(x_ref.at[tile], mask=mask, other=0)  # [Br, Bh]
    r = pltriton.load(r_ref.at[tile], mask=mask, other=0)
    s = x.astype(jnp.float32) + r.astype(jnp.float32)  # padded lanes 0
    mean = jnp.sum(s, axis=1, keepdims=True) / hidden  # [Br, 1]
    d = jnp.where(col_ok[None, :], s - mean, 0.0)
    var = jnp.sum(d * d, axis=1, keepdims=True) / hidden
    w = pltriton.load(w_ref.at[cols], mask=col_ok, other=0).astype(jnp.float32)  # [Bh]
    b = pltriton.load(b_ref.at[cols], mask=col_ok, other=0).astype(jnp.float32)
    out = d * jax.lax.rsqrt(var + eps) * w[None, :] + b[None, :]
    pltriton.store(out_ref.at[tile], out.astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows", "num_warps", "interpret"))
def _add_layer_norm(x, residual, weight, bias, *, eps: float, block_rows: int | None = None,
                    num_warps: int = 4, interpret: bool = False):
    hidden = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.shape} {residual.dtype} must match x {x.shape} "
                         f"{x.dtype}")
    if weight.shape != (hidden,) or bias.shape != (hidden,):
        raise ValueError(f"weight {weight.shape}, bias {bias.shape} must be [{hidden}]")
    block_h = pl.next_power_of_2(hidden)
    block_rows = block_rows or max(1, _TILE_ELEMENTS // block_h)
    rows = x.reshape(-1, hidden)  # [T, H]
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, block_rows=block_rows, block_h=block_h),
        grid=(pl.cdiv(rows.shape[0], block_rows),),
        out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="add_layer_norm",
    )(rows, residual.reshape(rows.shape), weight, bias)
    return out.reshape(x.shape)


def add_layer_norm(x, residual, weight, bias, eps: float, *, block_rows: int | None = None,
                   num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """x, residual [T, H] (or [..., H]; same dtype: fp32/fp16/bf16), weight, bias [H], eps a
    Python float -> LayerNorm(x + residual) [T, H] in x's dtype; `add_layer_norm_reference`'s
    contract. block_rows (rows per program; default: 4096 elements of padded H) and num_warps are
    the tile knobs."""
    return _add_layer_norm(x, residual, weight, bias, eps=float(eps), block_rows=block_rows,
                           num_warps=num_warps, interpret=interpret)
