"""Activations quantised per token for an FP8 GEMM (W8A8), optionally after the RMSNorm that
precedes the projection (a decoder's input norms): one pass over x.

  x           [T, H]  bf16, f16 or f32 (a step's tokens)
  norm_weight [H]     x's dtype, optional (or stacked across layers, [L, H], read at row
                      `layer`: stacked.py); given, h = rms_norm_reference(x), else h = x
  ->  values [T, H] float8_e4m3fn, scale [T] fp32: h ~ values * scale, scale = max|h| / 448

XLA makes two or three kernels of it (the norm's sum of squares, the max of |h|, the scaled
cast), each reading x; here one program holds a block of rows whole in registers (H padded to a
power of two, the extra lanes 0, which neither the sum of squares nor the max sees) and writes
both outputs. Rows past T are masked on load and store.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.stacked import check_stacked, prefix

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale
_TILE_ELEMENTS = 4096  # default block_rows * padded H


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x [..., H]: normalised in fp32, cast back before the weight (as HF's LlamaRMSNorm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def row_scales(amax: jax.Array) -> jax.Array:
    """Absolute maxima (per row, or of any other slice) -> their fp32 scales (max / 448)."""
    return jnp.maximum(amax, MIN_SCALE) / FP8_MAX


def to_fp8(h: jax.Array, scale: jax.Array) -> jax.Array:
    """h [R, C] fp32 over its rows' scales [R] -> float8_e4m3fn, saturated."""
    return jnp.clip(h / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8)


def fp8_quant_reference(x: jax.Array, norm_weight: jax.Array | None = None,
                        eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """The module's contract in jnp."""
    h = x if norm_weight is None else rms_norm_reference(x, norm_weight, eps)
    h32 = h.astype(jnp.float32)
    scale = row_scales(jnp.max(jnp.abs(h32), axis=-1))  # [T]
    return to_fp8(h32, scale), scale


def _kernel(x_ref, *refs, eps, block_rows, block_h, layer):
    """x_ref [T, H], (norm_ref [(L,) H]) -> q_ref [T, H], s_ref [T] for this program's rows."""
    norm_ref, (q_ref, s_ref) = (refs[0], refs[1:]) if len(refs) == 3 else (None, refs)
    num_rows, hidden = x_ref.shape
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # [Br]
    cols = jnp.arange(block_h, dtype=jnp.int32)  # [Bh]
    col_ok = cols < hidden
    row_ok = rows < num_rows
    mask = row_ok[:, None] & col_ok[None, :]
    tile = (rows[:, None], cols[None, :])
    x = pltriton.load(x_ref.at[tile], mask=mask, other=0)  # [Br, Bh]
    h = x.astype(jnp.float32)
    if norm_ref is not None:
        rms = jax.lax.rsqrt(jnp.sum(h * h, axis=1, keepdims=True) / hidden + eps)  # [Br, 1]
        w = pltriton.load(norm_ref.at[(*prefix(norm_ref, 1, layer), cols)], mask=col_ok,
                          other=0).astype(jnp.float32)
        # HF's roundings: the normalised x to x's dtype, then its product with the weight
        h = ((h * rms).astype(x.dtype).astype(jnp.float32) * w[None, :]).astype(x.dtype)
        h = h.astype(jnp.float32)
    scale = row_scales(jnp.max(jnp.abs(h), axis=1))  # [Br]
    pltriton.store(s_ref.at[rows], scale, mask=row_ok)
    pltriton.store(q_ref.at[tile], to_fp8(h, scale), mask=mask)


@functools.partial(jax.jit, static_argnames=("eps", "layer", "block_rows", "num_warps",
                                             "interpret"))
def fp8_quant(x: jax.Array, norm_weight: jax.Array | None = None, *, eps: float = 1e-6,
              layer: int | None = None, block_rows: int | None = None, num_warps: int = 4,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The Pallas (Triton) kernel; `fp8_quant_reference`'s contract. block_rows (rows a
    program; default: _TILE_ELEMENTS of padded H) and num_warps are the tile knobs; layer: the
    row of a stacked norm_weight."""
    num_rows, hidden = x.shape
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                  jnp.dtype(jnp.float32)):
        raise ValueError(f"x's dtype {x.dtype}: bfloat16, float16 or float32")
    norm = ()
    if norm_weight is not None:
        check_stacked("norm_weight", norm_weight, (hidden,), layer)
        if norm_weight.dtype != x.dtype:
            raise ValueError(f"norm_weight {norm_weight.dtype}: want x's dtype {x.dtype}")
        norm = (norm_weight,)
    block_h = pl.next_power_of_2(hidden)
    block_rows = block_rows or max(1, _TILE_ELEMENTS // block_h)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, block_rows=block_rows, block_h=block_h, layer=layer),
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct((num_rows, hidden), FP8),
                   jax.ShapeDtypeStruct((num_rows,), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="fp8_quant",
    )(x, *norm)
