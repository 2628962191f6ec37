"""SwiGLU's activation quantised for an FP8 down projection: from the gate/up GEMM's unscaled
output, h = silu(gate) * up, then h as float8_e4m3fn with one scale per token (its absolute
max / 448), the operand the down projection's W8A8 GEMM reads.

XLA spends two passes over the gate/up output on it (the per-token max, then the scaled cast),
each reading [T, 2, I] from HBM; this kernel reads it once from HBM and once more from L2.

Design. One Triton program per block of `block_rows` tokens. A row of I (14,336 for an 8B
model) does not fit in registers, so the program walks it in `block_cols` chunks twice: the
first pass keeps the running max of |h|, the second recomputes h (its gate and up reread, now
from L2) and stores it scaled; a chunk as wide as the row (block_cols >= I) holds h in registers
and reads the row once. Everything is in fp32: the GEMM's output times both scales, the
SiLU, the product. Lanes past I and rows past T are masked on load (to 0, so h = 0 there) and
on store.

  y       [T, 2 * I]  the GEMM's output, gate columns then up columns (the fused [T, 2, I])
  x_scale [T]         fp32, the GEMM's per-token activation scale
  w_scale [2 * I]     fp32, its per-output-channel weight scale (or stacked across layers,
                      [L, 2 * I], read at row `layer`: stacked.py)
  ->  values [T, I] float8_e4m3fn, scale [T] fp32: h ~ values * scale
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import ptx
from pallas_kernels.fp8_quant import FP8, row_scales, to_fp8
from pallas_kernels.stacked import check_stacked, prefix


def silu_mul_fp8_reference(y: jax.Array, x_scale: jax.Array,
                           w_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """y [T, 2 * I], x_scale [T], w_scale [2 * I] -> (values [T, I] float8_e4m3fn, scale [T]
    fp32); the module's contract, in jnp."""
    g, u = jnp.split(y.astype(jnp.float32) * x_scale[:, None] * w_scale[None, :], 2, axis=1)
    h = g * jax.nn.sigmoid(g) * u  # [T, I]
    scale = row_scales(jnp.max(jnp.abs(h), axis=1))  # [T]
    return to_fp8(h, scale), scale


_LOG2E = 1.4426950408889634


def silu_mul(gate: jax.Array, up: jax.Array, interpret: bool = False) -> jax.Array:
    """silu(gate) * up in fp32, the inputs widened first: the kernels' SwiGLU, as
    1 / (1 + 2^(-gate log2 e)) by ptx.py's one-instruction exp2 and reciprocal, as fast-math
    CUDA takes it (libdevice's exp and the exact division cost several instructions each, in
    loops bound by their instructions)."""
    g = gate.astype(jnp.float32)
    sigmoid = ptx.reciprocal(1 + ptx.exp2(g * -_LOG2E, interpret), interpret)
    return g * sigmoid * up.astype(jnp.float32)


def _kernel(y_ref, xs_ref, ws_ref, q_ref, s_ref, *, block_rows, block_cols, layer, interpret):
    """y_ref [T, 2I], xs_ref [T], ws_ref [2I] -> q_ref [T, I], s_ref [T] for this program's
    rows."""
    num_rows, width = q_ref.shape
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)  # [Br]
    row_ok = rows < num_rows
    x_scale = pltriton.load(xs_ref.at[rows], mask=row_ok, other=0)  # [Br]
    num_chunks = pl.cdiv(width, block_cols)
    ws_row = prefix(ws_ref, 1, layer)

    def h_chunk(chunk):  # -> h [Br, Bc] (0 on masked lanes), its tile and mask
        cols = chunk * block_cols + jnp.arange(block_cols, dtype=jnp.int32)  # [Bc]
        col_ok = cols < width
        mask = row_ok[:, None] & col_ok[None, :]
        gate = pltriton.load(y_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)
        up = pltriton.load(y_ref.at[rows[:, None], (cols + width)[None, :]], mask=mask,
                           other=0)
        gate_scale = pltriton.load(ws_ref.at[(*ws_row, cols)], mask=col_ok, other=0)
        up_scale = pltriton.load(ws_ref.at[(*ws_row, cols + width)], mask=col_ok, other=0)
        g = gate.astype(jnp.float32) * x_scale[:, None] * gate_scale[None, :]
        u = up.astype(jnp.float32) * x_scale[:, None] * up_scale[None, :]
        return silu_mul(g, u, interpret), (rows[:, None], cols[None, :]), mask

    def store_scale(amax):  # -> scale [Br]
        scale = row_scales(amax)
        pltriton.store(s_ref.at[rows], scale, mask=row_ok)
        return scale

    def store_values(h, scale, tile, mask):
        pltriton.store(q_ref.at[tile], to_fp8(h, scale), mask=mask)

    if num_chunks == 1:  # the whole row in registers: read once
        h, tile, mask = h_chunk(0)
        store_values(h, store_scale(jnp.max(jnp.abs(h), axis=1)), tile, mask)
        return

    def max_of_chunk(chunk, amax):
        h, _, _ = h_chunk(chunk)
        return jnp.maximum(amax, jnp.max(jnp.abs(h), axis=1))

    scale = store_scale(jax.lax.fori_loop(0, num_chunks, max_of_chunk,
                                          jnp.zeros(block_rows, jnp.float32)))  # [Br]

    def store_chunk(chunk, carry):
        h, tile, mask = h_chunk(chunk)
        store_values(h, scale, tile, mask)
        return carry

    jax.lax.fori_loop(0, num_chunks, store_chunk, 0)


@functools.partial(jax.jit, static_argnames=("layer", "block_rows", "block_cols", "num_warps",
                                             "interpret"))
def silu_mul_fp8(y: jax.Array, x_scale: jax.Array, w_scale: jax.Array, *,
                 layer: int | None = None, block_rows: int = 1, block_cols: int = 2048,
                 num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """y [T, 2 * I] (fp16/bf16/fp32), x_scale [T], w_scale [2 * I] fp32 -> (values [T, I]
    float8_e4m3fn, scale [T] fp32): `silu_mul_fp8_reference`'s contract. block_rows (tokens a
    program), block_cols (a chunk of I, a power of two) and num_warps are the tile knobs;
    layer: the row of a stacked w_scale."""
    num_rows, double_width = y.shape
    if double_width % 2 or x_scale.shape != (num_rows,):
        raise ValueError(f"y {y.shape} must be [T, 2 * I] with x_scale [T]; got "
                         f"{x_scale.shape}")
    check_stacked("w_scale", w_scale, (double_width,), layer)
    width = double_width // 2
    block_cols = min(block_cols, pl.next_power_of_2(width))
    return pl.pallas_call(
        functools.partial(_kernel, block_rows=block_rows, block_cols=block_cols, layer=layer,
                          interpret=interpret),
        grid=(pl.cdiv(num_rows, block_rows),),
        out_shape=(jax.ShapeDtypeStruct((num_rows, width), FP8),
                   jax.ShapeDtypeStruct((num_rows,), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="silu_mul_fp8",
    )(y, x_scale.astype(jnp.float32), w_scale.astype(jnp.float32))
