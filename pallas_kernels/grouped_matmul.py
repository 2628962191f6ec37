"""Grouped matmul for MoE experts: rows sorted by expert, each group times its own matrix; and
the experts' gate/up pair fused into one pass (`grouped_swiglu`).

Same contract as `jax.lax.ragged_dot(x, w, group_sizes)`: x [M, K] holds the rows of group 0,
then group 1, ...; w [G, K, N]; rows past sum(group_sizes) come out zero. XLA on Hopper (jax
0.11.2) lowers ragged_dot as a dense dot over every group, all of them multiplied whatever their
row count (docs/lab/); this kernel does only the useful work.

Work items are (group, row tile) pairs: a tile of `block_m` rows that holds rows of several
groups is visited once per group, each visit masking to its own rows, so every expert's weights
are read about once per step even when each has only a few rows (decode). One extra item group,
the rows past the last group, writes zeros; every output row is stored exactly once.
`grouped_swiglu` loads each x tile once for both matrices and writes silu(gate) * up, so the
[M, 2N] gate/up activations never reach memory.

FP8 experts (W8A16): w in float8_e4m3fn with a scale per (group, output column) [G, N]; each
[Bk, Bn] weight tile is cast to x's dtype after its load (half the weight bytes read) and the
accumulator is scaled once per tile, before silu: x @ (w * s) = (x @ w) * s column by column.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _reference_f32(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   scale: jax.Array | None = None) -> jax.Array:
    """x [M, K], w [G, K, N] (scale [G, N]: w's columns times it), group_sizes [G] -> [M, N]
    fp32: every group's dense product, each row's own picked, rows past the groups zero."""
    if scale is not None:
        w = w.astype(jnp.float32) * scale.astype(jnp.float32)[:, None, :]
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(x.shape[0])
    row_group = jnp.sum(rows[:, None] >= ends[None, :], axis=1)  # [M]; G past the last group
    products = jnp.einsum("mk,gkn->gmn", x, w, preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(products, jnp.minimum(row_group, w.shape[0] - 1)[None, :, None],
                                 axis=0)[0]
    return jnp.where((row_group < w.shape[0])[:, None], picked, 0)


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                             scale: jax.Array | None = None) -> jax.Array:
    return _reference_f32(x, w, group_sizes, scale).astype(x.dtype)


def grouped_swiglu_reference(x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                             group_sizes: jax.Array,
                             scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """silu(x @ w_gate[g]) * (x @ w_up[g]) per row, in fp32, cast once."""
    gate_scale, up_scale = scales or (None, None)
    gate = _reference_f32(x, w_gate, group_sizes, gate_scale)
    up = _reference_f32(x, w_up, group_sizes, up_scale)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def _work_items(group_sizes: jax.Array, num_rows: int, block_m: int):
    """(group, row tile) pairs that share rows, in group order, padded to a static count.

    Returns item_group, item_tile [I] and group_bounds [G + 2] (starts, with the tail group G
    spanning [sum(group_sizes), num_rows)); items past the real ones get group -1.
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), num_rows)
    bounds = jnp.concatenate([jnp.zeros(1, jnp.int32), ends, jnp.full(1, num_rows, jnp.int32)])
    starts, stops = bounds[:-1], bounds[1:]  # [G + 1]
    first_tile = starts // block_m
    num_tiles = jnp.where(stops > starts, (stops - 1) // block_m - first_tile + 1, 0)
    # Each group's rows add at most one tile beyond the ones it fills alone.
    max_items = pl.cdiv(num_rows, block_m) + num_groups
    item_group = jnp.repeat(jnp.arange(num_groups + 1, dtype=jnp.int32), num_tiles,
                            total_repeat_length=max_items)
    first_item = jnp.cumsum(num_tiles) - num_tiles  # [G + 1]
    items = jnp.arange(max_items, dtype=jnp.int32)
    item_tile = first_tile[item_group] + items - first_item[item_group]
    item_group = jnp.where(items < jnp.sum(num_tiles), item_group, -1)
    return item_group, item_tile, bounds


def _kernel(item_group_ref, item_tile_ref, bounds_ref, x_ref, *refs, block_m, block_n, block_k,
            num_groups, num_weights):
    """refs: one weight (x @ w) or two (silu(x @ w_gate) * (x @ w_up)), then a [G, N] scale per
    weight when they are FP8, then the output."""
    w_refs, scale_refs, out_ref = refs[:num_weights], refs[num_weights:-1], refs[-1]
    item, n_tile = pl.program_id(0), pl.program_id(1)
    group = item_group_ref[item]
    num_rows, k_dim = x_ref.shape
    n_dim = out_ref.shape[-1]
    rows = item_tile_ref[item] * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [Bm]
    cols = n_tile * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [Bn]
    col_mask = cols < n_dim

    def group_rows():  # [Bm] bool; only where group is a real or the tail group
        return (rows >= bounds_ref[group]) & (rows < bounds_ref[group + 1])

    def store(acc, row_mask):
        pltriton.store(out_ref.at[rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
                       mask=row_mask[:, None] & col_mask[None, :])

    @pl.when(group == num_groups)  # the rows past the last expert's
    def _():
        store(jnp.zeros((block_m, block_n), jnp.float32), group_rows())

    @pl.when((group >= 0) & (group < num_groups))
    def _():
        row_mask = group_rows()
        precision = (jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32
                     else jax.lax.Precision.DEFAULT)

        def k_step(kt, accs):
            ks = kt * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [Bk]
            k_mask = ks < k_dim
            x = pltriton.load(x_ref.at[rows[:, None], ks[None, :]],
                              mask=row_mask[:, None] & k_mask[None, :], other=0)  # [Bm, Bk]
            w_idx, w_mask = (group, ks[:, None], cols[None, :]), k_mask[:, None] & col_mask[None, :]
            return tuple(
                acc + pltriton.dot(x, pltriton.load(w_ref.at[w_idx], mask=w_mask, other=0.0)
                                   .astype(x.dtype), precision=precision)  # [Bk, Bn] weights
                for acc, w_ref in zip(accs, w_refs))

        accs = jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), k_step,
                                 tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in w_refs))
        accs = tuple(acc * pltriton.load(scale_ref.at[group, cols], mask=col_mask,
                                         other=0)[None, :].astype(jnp.float32)
                     for acc, scale_ref in zip(accs, scale_refs)) + accs[len(scale_refs):]
        if len(accs) == 1:
            store(accs[0], row_mask)
        else:  # silu(gate) * up
            gate, up = accs
            store(gate / (1.0 + jnp.exp(-gate)) * up, row_mask)


def _block_m(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about the mean group size (decode: few rows an expert), 16 to 128 (the
    tile sweep of benchmarks/moe_gemm_gpu.py --sweep preferred 128 rows with 8 warps once
    experts get >= 128 rows)."""
    return min(128, max(16, 1 << max(0, (num_rows // max(num_groups, 1) - 1).bit_length())))


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def _grouped(x, weights, group_sizes, scales=(), *, block_m: int | None = None,
             block_n: int | None = None, block_k: int = 64, num_warps: int | None = None,
             num_stages: int = 3, interpret: bool = False):
    num_rows, k_dim = x.shape
    num_groups, w_k, n_dim = weights[0].shape
    if (any(w.shape != weights[0].shape for w in weights) or w_k != k_dim
            or group_sizes.shape != (num_groups,)):
        raise ValueError(f"x {x.shape}, w {[w.shape for w in weights]}, group_sizes "
                         f"{group_sizes.shape}: need x [M, K], w [G, K, N], group_sizes [G]")
    if scales and [s.shape for s in scales] != [(num_groups, n_dim)] * len(weights):
        raise ValueError(f"scales {[s.shape for s in scales]}: need one [G, N] per weight")
    block_m = block_m or _block_m(num_rows, num_groups)
    # 128 columns also for the fused pass's two accumulators: the sweep's best
    # (benchmarks/moe_gemm_gpu.py --sweep, docs/lab/).
    block_n = block_n or 128
    num_warps = num_warps or (8 if block_m >= 128 else 4)
    item_group, item_tile, bounds = _work_items(group_sizes, num_rows, block_m)
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               num_groups=num_groups, num_weights=len(weights))
    # FP8 weights travel as they are (cast per tile in the kernel); 16-bit ones in x's dtype
    weights = tuple(w if scales else w.astype(x.dtype) for w in weights)
    return pl.pallas_call(
        kernel,
        grid=(item_group.shape[0], pl.cdiv(n_dim, block_n)),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul" if len(weights) == 1 else "grouped_swiglu",
    )(item_group, item_tile, bounds, x, *weights, *scales)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                   scale: jax.Array | None = None, **tiles) -> jax.Array:
    """x [M, K] (rows sorted by group), w [G, K, N], group_sizes [G] int -> [M, N] in x's dtype.
    scale [G, N]: w is FP8 and its columns are scaled by it. tiles: block_m, block_n, block_k,
    num_warps, num_stages (defaults by shape), interpret."""
    return _grouped(x, (w,), group_sizes, () if scale is None else (scale,), **tiles)


def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array,
                   scales: tuple[jax.Array, jax.Array] | None = None, **tiles) -> jax.Array:
    """silu(x @ w_gate[g]) * (x @ w_up[g]) for each row's group g: x [M, K], w_gate, w_up
    [G, K, N] -> [M, N] in x's dtype; rows past the groups zero. scales: ([G, N], [G, N]) for
    FP8 w_gate, w_up. tiles: as grouped_matmul."""
    return _grouped(x, (w_gate, w_up), group_sizes, tuple(scales or ()), **tiles)
