"""SwiGLU's activation quantised for an FP8 down projection: from the gate/up GEMM's unscaled
output, h = silu(gate) * up, then h as float8_e4m3fn with one scale per token (its absolute
max / 448), the operand the down projection's W8A8 GEMM reads.

XLA spends two passes over the gate/up output on it (the per-token max, then the scaled cast).
So does this module where a row is wider than a chunk (the second read from L2 where the product
fits it), but every (token blocks, chunk) is a short program of its own in both passes: any
token count fills the GPU, and many programs' loads are in flight at once, where one program a
token walking its row's chunks in turn left the copy bandwidth mostly idle.

Design. A row of I (14,336 for an 8B model) does not fit in registers, so it is cut into
`block_cols` chunks; a program takes `row_blocks` blocks of `block_rows` tokens of one chunk in
turn, each block's loads issued before the block before it is computed (the kernels are
latency-bound otherwise: load, compute, reduce and store, one after the other, with nothing of
the program's own to overlap), the chunk's channel scales read once. The first kernel writes
each chunk's max |h| ([chunks, T] fp32); the second reads a row's chunk maxima (a few words),
recomputes its chunk of h (the same instructions: the same fp32 values) and stores it scaled;
its first chunk's programs store the scale. A row of at most ONE_READ_MAX_WIDTH (SmolLM2's 1,536,
the test models) is one chunk by default: one kernel holds h in registers and reads the row once.
Everything is in fp32: the GEMM's output times both scales, the SiLU, the product. Lanes past I
and rows past T are masked on load (to 0, so h = 0 there) and on store.

With a static scale (a checkpoint's `input_scale` of the down projection: vLLM's `activation_scheme:
static`) no row max is needed: one kernel of the same tiles reads each chunk once and stores it
scaled, at any width.

  y       [T, 2 * I]  the GEMM's output, gate columns then up columns (the fused [T, 2, I])
  x_scale [T]         fp32, the GEMM's per-token activation scale
  w_scale [2 * I]     fp32, its per-output-channel weight scale (or stacked across layers,
                      [L, 2 * I], read at row `layer`: stacked.py)
  static_scale []     fp32, optional (or stacked, [L], at `static_layer`): every token's scale
  ->  values [T, I] float8_e4m3fn, scale [T] fp32: h ~ values * scale (saturated at +-448)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import ptx
from pallas_kernels.fp8_quant import FP8, row_scales, static_operand, to_fp8, token_scales
from pallas_kernels.stacked import check_stacked, prefix


def silu_mul_fp8_reference(y: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                           static_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """y [T, 2 * I], x_scale [T], w_scale [2 * I] (, static_scale []) -> (values [T, I]
    float8_e4m3fn, scale [T] fp32); the module's contract, in jnp."""
    g, u = jnp.split(y.astype(jnp.float32) * x_scale[:, None] * w_scale[None, :], 2, axis=1)
    h = g * jax.nn.sigmoid(g) * u  # [T, I]
    scale = token_scales(h, static_scale)  # [T]
    return to_fp8(h, scale), scale


_LOG2E = 1.4426950408889634
# The default tiles (block_rows, block_cols, row_blocks): rows wider than ONE_READ_MAX_WIDTH from
# Nsight Compute's kernel times at an 8B model's I (docs/lab, session 37); narrower rows as one
# chunk, a token a block (h in registers)
CHUNKED_TILES = (4, 512, 4)
ONE_READ_MAX_WIDTH = 2048


def silu_mul(gate: jax.Array, up: jax.Array, interpret: bool = False) -> jax.Array:
    """silu(gate) * up in fp32, the inputs widened first: the kernels' SwiGLU, as
    1 / (1 + 2^(-gate log2 e)) by ptx.py's one-instruction exp2 and reciprocal, as fast-math
    CUDA takes it (libdevice's exp and the exact division cost several instructions each, in
    loops bound by their instructions)."""
    g = gate.astype(jnp.float32)
    sigmoid = ptx.reciprocal(1 + ptx.exp2(g * -_LOG2E, interpret), interpret)
    return g * sigmoid * up.astype(jnp.float32)


def _each_row_block(y_ref, xs_ref, ws_ref, visit, *, block_rows, block_cols, row_blocks,
                    layer, interpret):
    """Calls visit(h, rows, row_ok, tile, mask) for each of this program's `row_blocks` blocks
    of `block_rows` tokens in its chunk of columns: h = silu(gate) * up [Br, Bc] (0 on masked
    lanes), rows [Br], the rows' mask and the tile and mask in [T, I]. The chunk's channel
    scales are read once, and each block's loads are issued before the block before it is
    computed, so that a program's reads stay in flight while it computes."""
    num_rows, width = y_ref.shape[0], y_ref.shape[1] // 2
    cols = pl.program_id(1) * block_cols + jnp.arange(block_cols, dtype=jnp.int32)  # [Bc]
    col_ok = cols < width
    first_block = pl.program_id(0) * row_blocks  # program ids outside the loop (interpret mode)
    ws_row = prefix(ws_ref, 1, layer)
    gate_scale = pltriton.load(ws_ref.at[(*ws_row, cols)], mask=col_ok, other=0)
    up_scale = pltriton.load(ws_ref.at[(*ws_row, cols + width)], mask=col_ok, other=0)

    def load(k):  # block k's rows [Br], x_scale [Br], gate and up [Br, Bc]; none past the last
        rows = (first_block + k) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
        row_ok = (rows < num_rows) & (k < row_blocks)
        mask = row_ok[:, None] & col_ok[None, :]
        x_scale = pltriton.load(xs_ref.at[rows], mask=row_ok, other=0)
        gate = pltriton.load(y_ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)
        up = pltriton.load(y_ref.at[rows[:, None], (cols + width)[None, :]], mask=mask, other=0)
        return rows, x_scale, gate, up

    def compute(loaded):
        rows, x_scale, gate, up = loaded
        g = gate.astype(jnp.float32) * x_scale[:, None] * gate_scale[None, :]
        u = up.astype(jnp.float32) * x_scale[:, None] * up_scale[None, :]
        row_ok = rows < num_rows
        visit(silu_mul(g, u, interpret), rows, row_ok, (rows[:, None], cols[None, :]),
              row_ok[:, None] & col_ok[None, :])

    def block(k, loaded):
        following = load(k + 1)
        compute(loaded)
        return following

    if row_blocks == 1:  # nothing to load ahead
        compute(load(0))
    else:
        jax.lax.fori_loop(0, row_blocks, block, load(0))


def _one_read_kernel(y_ref, xs_ref, ws_ref, q_ref, s_ref, **blocks):
    """The row in one chunk: y_ref [T, 2I] -> q_ref [T, I], s_ref [T] for this program's rows."""
    def visit(h, rows, row_ok, tile, mask):
        scale = row_scales(jnp.max(jnp.abs(h), axis=1))  # [Br]
        pltriton.store(s_ref.at[rows], scale, mask=row_ok)
        pltriton.store(q_ref.at[tile], to_fp8(h, scale), mask=mask)

    _each_row_block(y_ref, xs_ref, ws_ref, visit, **blocks)


def _static_kernel(y_ref, xs_ref, ws_ref, static_ref, q_ref, s_ref, *, static_index,
                   **blocks):
    """static_ref [L or 1], every token's scale at static_index: y_ref [T, 2I] -> q_ref [T, I]
    for this program's tiles, and s_ref [T] from the first chunk's programs."""
    first_chunk = pl.program_id(1) == 0

    def visit(h, rows, row_ok, tile, mask):
        scale = jnp.full((h.shape[0],), static_ref[static_index], jnp.float32)  # [Br]

        @pl.when(first_chunk)
        def _():
            pltriton.store(s_ref.at[rows], scale, mask=row_ok)

        pltriton.store(q_ref.at[tile], to_fp8(h, scale), mask=mask)

    _each_row_block(y_ref, xs_ref, ws_ref, visit, **blocks)


def _max_kernel(y_ref, xs_ref, ws_ref, m_ref, **blocks):
    """-> m_ref [chunks, T]: this chunk's max |h| of this program's rows."""
    chunk = pl.program_id(1)

    def visit(h, rows, row_ok, tile, mask):
        pltriton.store(m_ref.at[chunk, rows], jnp.max(jnp.abs(h), axis=1), mask=row_ok)

    _each_row_block(y_ref, xs_ref, ws_ref, visit, **blocks)


def _store_kernel(y_ref, xs_ref, ws_ref, m_ref, q_ref, s_ref, **blocks):
    """m_ref [chunks, T] (the first kernel's) -> q_ref [T, I] for this program's tiles, and
    s_ref [T] from the first chunk's programs."""
    num_chunks = m_ref.shape[0]
    chunks = jnp.arange(pl.next_power_of_2(num_chunks), dtype=jnp.int32)  # [C]
    first_chunk = pl.program_id(1) == 0

    def visit(h, rows, row_ok, tile, mask):
        maxima = pltriton.load(m_ref.at[chunks[:, None], rows[None, :]],
                               mask=(chunks < num_chunks)[:, None] & row_ok[None, :], other=0)
        scale = row_scales(jnp.max(maxima, axis=0))  # [Br]

        @pl.when(first_chunk)
        def _():
            pltriton.store(s_ref.at[rows], scale, mask=row_ok)

        pltriton.store(q_ref.at[tile], to_fp8(h, scale), mask=mask)

    _each_row_block(y_ref, xs_ref, ws_ref, visit, **blocks)


@functools.partial(jax.jit, static_argnames=("layer", "static_layer", "block_rows", "block_cols",
                                             "row_blocks", "num_warps", "interpret"))
def silu_mul_fp8(y: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                 static_scale: jax.Array | None = None, *, layer: int | None = None,
                 static_layer: int | None = None, block_rows: int | None = None,
                 block_cols: int | None = None, row_blocks: int | None = None, num_warps: int = 4,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """y [T, 2 * I] (fp16/bf16/fp32), x_scale [T], w_scale [2 * I] fp32 (, static_scale) ->
    (values [T, I] float8_e4m3fn, scale [T] fp32): `silu_mul_fp8_reference`'s contract.
    block_rows (tokens a block), block_cols (a chunk of I, a power of two), row_blocks (blocks a
    program, in turn) and num_warps are the tile knobs, each left None taken from
    CHUNKED_TILES, or for rows up to ONE_READ_MAX_WIDTH from one token and one block of the
    whole row; layer, static_layer: the rows of a stacked w_scale and static_scale."""
    num_rows, double_width = y.shape
    if double_width % 2 or x_scale.shape != (num_rows,):
        raise ValueError(f"y {y.shape} must be [T, 2 * I] with x_scale [T]; got "
                         f"{x_scale.shape}")
    check_stacked("w_scale", w_scale, (double_width,), layer)
    width = double_width // 2
    defaults = (1, width, 1) if width <= ONE_READ_MAX_WIDTH else CHUNKED_TILES
    block_rows, block_cols, row_blocks = (given or default for given, default in zip(
        (block_rows, block_cols, row_blocks), defaults))
    block_cols = min(pl.next_power_of_2(block_cols), pl.next_power_of_2(width))
    grid = (pl.cdiv(num_rows, block_rows * row_blocks), pl.cdiv(width, block_cols))
    call = functools.partial(
        pl.pallas_call, grid=grid, interpret=interpret, name="silu_mul_fp8",
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1))
    blocks = dict(block_rows=block_rows, block_cols=block_cols, row_blocks=row_blocks,
                  layer=layer, interpret=interpret)
    outputs = (jax.ShapeDtypeStruct((num_rows, width), FP8),
               jax.ShapeDtypeStruct((num_rows,), jnp.float32))
    args = (y, x_scale.astype(jnp.float32), w_scale.astype(jnp.float32))
    if static_scale is not None:
        static, static_index = static_operand(static_scale, static_layer)
        kernel = functools.partial(_static_kernel, static_index=static_index, **blocks)
        return call(kernel, out_shape=outputs)(*args, *static)
    if grid[1] == 1:
        return call(functools.partial(_one_read_kernel, **blocks), out_shape=outputs)(*args)
    maxima = call(functools.partial(_max_kernel, **blocks),
                  out_shape=jax.ShapeDtypeStruct((grid[1], num_rows), jnp.float32))(*args)
    return call(functools.partial(_store_kernel, **blocks), out_shape=outputs)(*args, maxima)
