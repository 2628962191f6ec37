"""Activations quantised per token for an FP8 GEMM (W8A8), optionally after the RMSNorm that
precedes the projection (a decoder's input norms): one pass over x.

  x           [T, H]  bf16, f16 or f32 (a step's tokens)
  norm_weight [H]     x's dtype, optional (or stacked across layers, [L, H], read at row
                      `layer`: stacked.py); given, h = rms_norm_reference(x), else h = x
  static_scale []     fp32, optional (or stacked, [L], at `static_layer`): a checkpoint's static
                      activation scale (vLLM's `activation_scheme: static`), used for every
                      token instead of its max
  ->  values [T, H] float8_e4m3fn, scale [T] fp32: h ~ values * scale, scale = max|h| / 448
                      (or the static scale, values saturated at +-448)

`fp8_quant_residual` first adds a residual to an FP8 GEMM's unscaled product (a decoder's o and
down projections feed the residual stream, which the next norm and projection read):

  y        [T, H]     the product, unscaled (y * y_scale * w_scale in the residual's dtype is
                      the projection's output, as models/quant.py's _fp8_scaled rounds it)
  y_scale  [T]        fp32, its per-token activation scales
  w_scale  [H]        fp32, its per-channel weight scales (or stacked, [L, H], at scale_layer)
  residual [T, H]     bf16, f16 or f32
  ->  x = residual + output (the new residual stream, the residual's dtype), then fp8_quant's
      values and scale of x (normalised first, given norm_weight, at norm_layer)

where XLA makes a kernel of the scaling and the add, and this kernel reads the stream again.

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


def token_scales(h: jax.Array, static_scale: jax.Array | None = None) -> jax.Array:
    """h [T, H] fp32 -> each token's scale [T]: its max |h| / 448, or the static scale []."""
    if static_scale is None:
        return row_scales(jnp.max(jnp.abs(h), axis=-1))
    return jnp.full(h.shape[:1], static_scale, jnp.float32)


def to_fp8(h: jax.Array, scale: jax.Array) -> jax.Array:
    """h [R, C] fp32 over its rows' scales [R] -> float8_e4m3fn, saturated."""
    return jnp.clip(h / scale[:, None], -FP8_MAX, FP8_MAX).astype(FP8)


def fp8_quant_reference(x: jax.Array, norm_weight: jax.Array | None = None, eps: float = 1e-6,
                        static_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The module's contract in jnp."""
    h = x if norm_weight is None else rms_norm_reference(x, norm_weight, eps)
    h32 = h.astype(jnp.float32)
    scale = token_scales(h32, static_scale)  # [T]
    return to_fp8(h32, scale), scale


def _tile(num_rows, hidden, block_rows, block_h):
    """This program's rows [Br] and columns [Bh], their masks, the [Br, Bh] tile and its mask."""
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # [Br]
    cols = jnp.arange(block_h, dtype=jnp.int32)  # [Bh]
    row_ok, col_ok = rows < num_rows, cols < hidden
    tile = (rows[:, None], cols[None, :])
    return rows, cols, row_ok, col_ok, tile, row_ok[:, None] & col_ok[None, :]


def _optional_refs(refs, has_norm: bool, has_static: bool) -> tuple:
    """The kernel's refs after its fixed inputs -> (norm_ref or None, static_ref or None, the
    outputs' refs)."""
    norm_ref = refs[0] if has_norm else None
    static_ref = refs[has_norm] if has_static else None
    return norm_ref, static_ref, refs[has_norm + has_static:]


def _kernel(x_ref, *refs, eps, block_rows, block_h, layer, has_norm, static_index):
    """x_ref [T, H], (norm_ref [(L,) H]), (static_ref [L or 1]) -> q_ref [T, H], s_ref [T] for
    this program's rows."""
    norm_ref, static_ref, (q_ref, s_ref) = _optional_refs(refs, has_norm,
                                                          static_index is not None)
    rows, cols, row_ok, col_ok, tile, mask = _tile(*x_ref.shape, block_rows, block_h)
    x = pltriton.load(x_ref.at[tile], mask=mask, other=0)  # [Br, Bh]
    _norm_quant(x, norm_ref, static_ref, q_ref, s_ref, rows, cols, row_ok, col_ok, tile, mask,
                eps=eps, layer=layer, static_index=static_index)


def _norm_quant(x, norm_ref, static_ref, q_ref, s_ref, rows, cols, row_ok, col_ok, tile, mask,
                *, eps, layer, static_index):
    """x [Br, Bh] (0 on masked lanes) -> its values and scales stored, normalised first given
    norm_ref; scaled by static_ref[static_index] given that, else by each row's max."""
    hidden = q_ref.shape[1]
    h = x.astype(jnp.float32)
    if norm_ref is not None:
        rms = jax.lax.rsqrt(jnp.sum(h * h, axis=1, keepdims=True) / hidden + eps)  # [Br, 1]
        w = pltriton.load(norm_ref.at[(*prefix(norm_ref, 1, layer), cols)], mask=col_ok,
                          other=0).astype(jnp.float32)
        # HF's roundings: the normalised x to x's dtype, then its product with the weight
        h = ((h * rms).astype(x.dtype).astype(jnp.float32) * w[None, :]).astype(x.dtype)
        h = h.astype(jnp.float32)
    if static_ref is None:
        scale = row_scales(jnp.max(jnp.abs(h), axis=1))  # [Br]
    else:
        scale = jnp.full((h.shape[0],), static_ref[static_index], jnp.float32)
    pltriton.store(s_ref.at[rows], scale, mask=row_ok)
    pltriton.store(q_ref.at[tile], to_fp8(h, scale), mask=mask)


def _residual_kernel(y_ref, ys_ref, ws_ref, r_ref, *refs, eps, block_rows, block_h,
                     scale_layer, norm_layer, has_norm, static_index):
    """y_ref [T, H], ys_ref [T], ws_ref [(L,) H], r_ref [T, H], (norm_ref [(L,) H]),
    (static_ref [L or 1]) -> x_ref [T, H] = r + the scaled product, q_ref [T, H], s_ref [T]
    for this program's rows."""
    norm_ref, static_ref, (x_ref, q_ref, s_ref) = _optional_refs(refs, has_norm,
                                                                 static_index is not None)
    rows, cols, row_ok, col_ok, tile, mask = _tile(*y_ref.shape, block_rows, block_h)
    y = pltriton.load(y_ref.at[tile], mask=mask, other=0).astype(jnp.float32)
    y_scale = pltriton.load(ys_ref.at[rows], mask=row_ok, other=0)
    w_scale = pltriton.load(ws_ref.at[(*prefix(ws_ref, 1, scale_layer), cols)], mask=col_ok,
                            other=0)
    residual = pltriton.load(r_ref.at[tile], mask=mask, other=0)
    # the projection's output rounded to the stream's dtype, then the add rounded: as XLA
    # rounds _fp8_scaled's product and the residual add
    out = (y * y_scale[:, None] * w_scale[None, :]).astype(residual.dtype)
    x = (residual.astype(jnp.float32) + out.astype(jnp.float32)).astype(residual.dtype)
    pltriton.store(x_ref.at[tile], x, mask=mask)
    _norm_quant(x, norm_ref, static_ref, q_ref, s_ref, rows, cols, row_ok, col_ok, tile, mask,
                eps=eps, layer=norm_layer, static_index=static_index)


def _checked_norm(name: str, x: jax.Array, norm_weight: jax.Array | None,
                  layer: int | None) -> tuple:
    """The row stream x's dtype and norm_weight's shape and dtype checked -> the kernel's norm
    operand: (norm_weight,), or () without one."""
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                  jnp.dtype(jnp.float32)):
        raise ValueError(f"{name}'s dtype {x.dtype}: bfloat16, float16 or float32")
    if norm_weight is None:
        return ()
    check_stacked("norm_weight", norm_weight, (x.shape[1],), layer)
    if norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight {norm_weight.dtype}: want {name}'s dtype {x.dtype}")
    return (norm_weight,)


def static_operand(static_scale: jax.Array | None, layer: int | None) -> tuple[tuple, int | None]:
    """A static scale ([] or stacked [L] at layer) -> the kernel's operand (a 1-D fp32 array, or
    () without one) and the index the kernel reads it at."""
    if static_scale is None:
        return (), None
    check_stacked("static_scale", static_scale, (), layer)
    flat = static_scale.astype(jnp.float32).reshape(-1)
    return (flat,), 0 if layer is None else layer


def _row_tiles(hidden: int, block_rows: int | None) -> tuple[int, int]:
    """(block_h: H padded to a power of two, block_rows: default _TILE_ELEMENTS of it)."""
    block_h = pl.next_power_of_2(hidden)
    return block_h, block_rows or max(1, _TILE_ELEMENTS // block_h)


@functools.partial(jax.jit, static_argnames=("eps", "layer", "static_layer", "block_rows",
                                             "num_warps", "interpret"))
def fp8_quant(x: jax.Array, norm_weight: jax.Array | None = None,
              static_scale: jax.Array | None = None, *, eps: float = 1e-6,
              layer: int | None = None, static_layer: int | None = None,
              block_rows: int | None = None, num_warps: int = 4,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The Pallas (Triton) kernel; `fp8_quant_reference`'s contract. block_rows (rows a
    program; default: _TILE_ELEMENTS of padded H) and num_warps are the tile knobs; layer,
    static_layer: the rows of a stacked norm_weight and static_scale."""
    num_rows, hidden = x.shape
    norm = _checked_norm("x", x, norm_weight, layer)
    static, static_index = static_operand(static_scale, static_layer)
    block_h, block_rows = _row_tiles(hidden, block_rows)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, block_rows=block_rows, block_h=block_h, layer=layer,
                          has_norm=bool(norm), static_index=static_index),
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct((num_rows, hidden), FP8),
                   jax.ShapeDtypeStruct((num_rows,), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="fp8_quant",
    )(x, *norm, *static)


def fp8_quant_residual_reference(y: jax.Array, y_scale: jax.Array, w_scale: jax.Array,
                                 residual: jax.Array, norm_weight: jax.Array | None = None,
                                 eps: float = 1e-6, static_scale: jax.Array | None = None
                                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`fp8_quant_residual`'s contract in jnp: (x, values, scale)."""
    out = (y.astype(jnp.float32) * y_scale[:, None] * w_scale[None, :]).astype(residual.dtype)
    x = residual + out
    return (x, *fp8_quant_reference(x, norm_weight, eps, static_scale))


@functools.partial(jax.jit, static_argnames=("eps", "scale_layer", "norm_layer", "static_layer",
                                             "block_rows", "num_warps", "interpret"))
def fp8_quant_residual(y: jax.Array, y_scale: jax.Array, w_scale: jax.Array, residual: jax.Array,
                       norm_weight: jax.Array | None = None,
                       static_scale: jax.Array | None = None, *, eps: float = 1e-6,
                       scale_layer: int | None = None, norm_layer: int | None = None,
                       static_layer: int | None = None, block_rows: int | None = None,
                       num_warps: int = 4,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Pallas (Triton) kernel; `fp8_quant_residual_reference`'s contract (the module
    docstring). scale_layer, norm_layer, static_layer: the rows of a stacked w_scale,
    norm_weight and static_scale; the tile knobs as fp8_quant's."""
    num_rows, hidden = residual.shape
    norm = _checked_norm("residual", residual, norm_weight, norm_layer)
    static, static_index = static_operand(static_scale, static_layer)
    if y.shape != residual.shape or y_scale.shape != (num_rows,):
        raise ValueError(f"y {y.shape} and y_scale {y_scale.shape}: want {residual.shape} and "
                         f"({num_rows},)")
    check_stacked("w_scale", w_scale, (hidden,), scale_layer)
    block_h, block_rows = _row_tiles(hidden, block_rows)
    return pl.pallas_call(
        functools.partial(_residual_kernel, eps=eps, block_rows=block_rows, block_h=block_h,
                          scale_layer=scale_layer, norm_layer=norm_layer,
                          has_norm=bool(norm), static_index=static_index),
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct((num_rows, hidden), residual.dtype),
                   jax.ShapeDtypeStruct((num_rows, hidden), FP8),
                   jax.ShapeDtypeStruct((num_rows,), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="fp8_quant_residual",
    )(y, y_scale.astype(jnp.float32), w_scale.astype(jnp.float32), residual, *norm, *static)
