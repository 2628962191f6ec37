"""Grouped matmul for MoE experts: rows sorted by expert, each group times its own matrix.

Same contract as `jax.lax.ragged_dot(x, w, group_sizes)`: x [M, K] holds the rows of group 0,
then group 1, ...; w [G, K, N]; rows past sum(group_sizes) come out zero. XLA on the H200 (jax
0.11.2) lowers ragged_dot as a dense dot over every group, ~100x the useful FLOPs
(benchmarks/moe_gemm_gpu.py); this kernel does only the useful work.

Work items are (group, row tile) pairs: a tile of `block_m` rows that holds rows of several
groups is visited once per group, each visit masking to its own rows, so every expert's weights
are read about once per step even when each has only a few rows (decode). One extra item group,
the rows past the last group, writes zeros; every output row is stored exactly once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def grouped_matmul_reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K], w [G, K, N], group_sizes [G] -> [M, N]: every group's dense product, masked."""
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(x.shape[0])
    row_group = jnp.sum(rows[:, None] >= ends[None, :], axis=1)  # [M]; G past the last group
    products = jnp.einsum("mk,gkn->gmn", x, w, preferred_element_type=jnp.float32)
    picked = jnp.take_along_axis(products, jnp.minimum(row_group, w.shape[0] - 1)[None, :, None],
                                 axis=0)[0]
    return jnp.where((row_group < w.shape[0])[:, None], picked, 0).astype(x.dtype)


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


def _kernel(item_group_ref, item_tile_ref, bounds_ref, x_ref, w_ref, out_ref, *, block_m,
            block_n, block_k, num_groups):
    item, n_tile = pl.program_id(0), pl.program_id(1)
    group = item_group_ref[item]
    num_rows, k_dim = x_ref.shape
    n_dim = w_ref.shape[-1]
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

        def k_step(kt, acc):
            ks = kt * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [Bk]
            k_mask = ks < k_dim
            x = pltriton.load(x_ref.at[rows[:, None], ks[None, :]],
                              mask=row_mask[:, None] & k_mask[None, :], other=0)  # [Bm, Bk]
            w = pltriton.load(w_ref.at[group, ks[:, None], cols[None, :]],
                              mask=k_mask[:, None] & col_mask[None, :], other=0)  # [Bk, Bn]
            return acc + pltriton.dot(x, w, precision=precision)

        store(jax.lax.fori_loop(0, pl.cdiv(k_dim, block_k), k_step,
                                jnp.zeros((block_m, block_n), jnp.float32)), row_mask)


def _block_m(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about the mean group size (decode: few rows an expert), 16 to 128.

    H200, Qwen3-30B-A3B's up-projection (benchmarks/moe_gemm_gpu.py --sweep, 2026-11-30):
    128-row tiles with 8 warps beat 64-row ones by 5-7% at 128 and 512 rows an expert.
    """
    return min(128, max(16, 1 << max(0, (num_rows // max(num_groups, 1) - 1).bit_length())))


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   block_m: int | None = None, block_n: int = 128, block_k: int = 64,
                   num_warps: int | None = None, num_stages: int = 3,
                   interpret: bool = False) -> jax.Array:
    """x [M, K] (rows sorted by group), w [G, K, N], group_sizes [G] int -> [M, N] in x's dtype."""
    num_rows, k_dim = x.shape
    num_groups, w_k, n_dim = w.shape
    if w_k != k_dim or group_sizes.shape != (num_groups,):
        raise ValueError(f"x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}: need "
                         "x [M, K], w [G, K, N], group_sizes [G]")
    block_m = block_m or _block_m(num_rows, num_groups)
    num_warps = num_warps or (8 if block_m >= 128 else 4)
    item_group, item_tile, bounds = _work_items(group_sizes, num_rows, block_m)
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               num_groups=num_groups)
    return pl.pallas_call(
        kernel,
        grid=(item_group.shape[0], pl.cdiv(n_dim, block_n)),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(item_group, item_tile, bounds, x, w.astype(x.dtype))
