"""Batched multi-LoRA: each token multiplied by its own adapter (Punica's SGMV idea), in two
Triton kernels around a base projection `base = x @ W`:

  y   = lora_shrink(x [T, H], a [S, H, R], slot_ids [T])         row t: x[t] @ a[slot_ids[t]]
  out = lora_expand(base [T, N], y [T, R], b [S, R, N], slot_ids)  row t: base[t] + y[t] @ b[slot]

Slot 0 is "no adapter" (the engine keeps its weights zero): the kernels never read its weights,
shrink writes zeros for its tokens and expand leaves their base rows as they are (the output
aliases base, so inside a jit where base is an intermediate those rows cost nothing).

Design. Tokens of one slot are scattered among the others, so the wrapper orders them by slot
(a stable argsort: `order`) without moving any data: the kernels read and write whole rows
through `order`. Work items are (slot, tile of `block_m` consecutive sorted rows) pairs, as the
MoE grouped matmul makes them (`grouped_matmul._work_items`): a tile holding tokens of several
slots is visited once per slot, each visit masked to its own rows, so each used adapter's tiles
are read about once per step and unused adapters never; the item count has a static bound
(row tiles + S), items past the real ones exit at once. The sort depends only on slot_ids, so
XLA's common-subexpression pass can share it among the calls of one step.
- shrink: programs (item, K split). R is small and H long, so at decode a few tokens would leave
  one program reading all of H alone; the reduction is split over H into fp32 partials that the
  wrapper sums (deterministic, no atomics).
- expand: programs (item, N tile), one [block_m, R] x [R, block_n] product each.
Any R works (no padding by the engine): tiles span R rounded up to a power of two, at least 16
(Triton's smallest dot), with the extra lanes masked; a multiple of 16 wastes none. H and N need
not be multiples of the tiles. slot_ids outside [0, S) are clipped, in the references too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.grouped_matmul import _block_m, _work_items
from pallas_kernels.split_sum import sum_splits

_MIN_DOT = 16  # Triton's smallest dot dimension
_TARGET_PROGRAMS = 256  # about two per SM on an H200 (132 SMs)


def _clip_slots(slot_ids: jax.Array, num_slots: int) -> jax.Array:
    return jnp.clip(slot_ids.astype(jnp.int32), 0, num_slots - 1)


def lora_shrink_reference(x: jax.Array, a: jax.Array, slot_ids: jax.Array) -> jax.Array:
    """x [T, H], a [S, H, R], slot_ids [T] -> [T, R] in x's dtype: every slot's product in exact
    fp32, each token's own picked."""
    slots = _clip_slots(slot_ids, a.shape[0])
    products = jnp.einsum("th,shr->tsr", x.astype(jnp.float32), a.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    return jnp.take_along_axis(products, slots[:, None, None], axis=1)[:, 0].astype(x.dtype)


def lora_expand_reference(base: jax.Array, y: jax.Array, b: jax.Array,
                          slot_ids: jax.Array) -> jax.Array:
    """base [T, N], y [T, R], b [S, R, N], slot_ids [T] -> base + y[t] @ b[slot_ids[t]] in base's
    dtype, in exact fp32: y spread over a one-hot slot axis, one product over (slot, rank)."""
    slots = _clip_slots(slot_ids, b.shape[0])
    one_hot = slots[:, None] == jnp.arange(b.shape[0], dtype=jnp.int32)  # [T, S]
    routed = jnp.where(one_hot[:, :, None], y.astype(jnp.float32)[:, None, :], 0)  # [T, S, R]
    delta = jnp.einsum("tsr,srn->tn", routed, b.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    return (base.astype(jnp.float32) + delta).astype(base.dtype)


def _sort_by_slot(slot_ids: jax.Array, num_slots: int, block_m: int):
    """-> item_slot [I] (-1 past the real items), item_tile [I], bounds [S + 2] (slot s owns
    sorted rows [bounds[s], bounds[s + 1])) and order [T] (sorted row -> token)."""
    slots = _clip_slots(slot_ids, num_slots)
    order = jnp.argsort(slots, stable=True).astype(jnp.int32)
    counts = jnp.bincount(slots, length=num_slots).astype(jnp.int32)
    item_slot, item_tile, bounds = _work_items(counts, slots.shape[0], block_m)
    return item_slot, item_tile, bounds, order


def _rank_block(rank: int) -> int:
    return max(_MIN_DOT, pl.next_power_of_2(rank))


def _tile_rows(item, item_slot_ref, item_tile_ref, bounds_ref, order_ref, block_m):
    """The item's sorted rows: (rows of its slot [Bm] bool, their tokens [Bm]). Called inside
    the kernels' pl.when branches, where program_id cannot be (interpret mode). Rows of other
    slots get token T, past the end: interpret mode stores a masked lane by writing back what
    it read, which on a duplicate of a real row's index could undo that row's store."""
    slot = item_slot_ref[item]
    sorted_rows = item_tile_ref[item] * block_m + jnp.arange(block_m, dtype=jnp.int32)
    in_slot = (sorted_rows >= bounds_ref[slot]) & (sorted_rows < bounds_ref[slot + 1])
    tokens = pltriton.load(order_ref.at[sorted_rows], mask=in_slot, other=order_ref.shape[0])
    return in_slot, tokens


def _precision(dtype) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _shrink_kernel(item_slot_ref, item_tile_ref, bounds_ref, order_ref, x_ref, a_ref, out_ref, *,
                   block_m, block_k, block_r, k_per_split):
    """out_ref [splits, T, R] fp32: this split's partial x @ a[slot] for the item's rows."""
    item, split = pl.program_id(0), pl.program_id(1)
    slot = item_slot_ref[item]
    hidden, rank = a_ref.shape[1], a_ref.shape[2]
    ranks = jnp.arange(block_r, dtype=jnp.int32)
    rank_ok = ranks < rank

    def rows():
        return _tile_rows(item, item_slot_ref, item_tile_ref, bounds_ref, order_ref, block_m)

    def store(acc, in_slot, tokens):
        pltriton.store(out_ref.at[split, tokens[:, None], ranks[None, :]], acc,
                       mask=in_slot[:, None] & rank_ok[None, :])

    @pl.when(slot == 0)
    def _():
        store(jnp.zeros((block_m, block_r), jnp.float32), *rows())

    @pl.when(slot > 0)
    def _():
        in_slot, tokens = rows()
        dtype = jnp.promote_types(x_ref.dtype, a_ref.dtype)

        def k_step(kt, acc):
            ks = split * k_per_split + kt * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [Bk]
            k_ok = ks < hidden
            xs = pltriton.load(x_ref.at[tokens[:, None], ks[None, :]],
                               mask=in_slot[:, None] & k_ok[None, :], other=0)  # [Bm, Bk]
            w = pltriton.load(a_ref.at[slot, ks[:, None], ranks[None, :]],
                              mask=k_ok[:, None] & rank_ok[None, :], other=0)  # [Bk, Br]
            return acc + pltriton.dot(xs.astype(dtype), w.astype(dtype),
                                      precision=_precision(dtype))

        acc = jax.lax.fori_loop(0, k_per_split // block_k, k_step,
                                jnp.zeros((block_m, block_r), jnp.float32))
        store(acc, in_slot, tokens)


def _num_splits(num_tiles: int, hidden: int, block_k: int) -> int:
    """Splits of H: enough programs to fill the GPU when tokens are few, each split at least
    four K steps long."""
    return max(1, min(pl.cdiv(hidden, 4 * block_k), _TARGET_PROGRAMS // num_tiles))


def _check_shrink(x, a, slot_ids) -> None:
    if x.ndim != 2 or a.ndim != 3 or a.shape[1] != x.shape[1] or slot_ids.shape != x.shape[:1]:
        raise ValueError(f"x {x.shape}, a {a.shape}, slot_ids {slot_ids.shape}: need x [T, H], "
                         f"a [S, H, R], slot_ids [T]")


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "num_splits", "num_warps",
                                             "interpret"))
def _shrink(x, a, slot_ids, *, block_m: int | None = None, block_k: int = 64,
            num_splits: int | None = None, num_warps: int = 4, interpret: bool = False):
    _check_shrink(x, a, slot_ids)
    num_tokens, hidden = x.shape
    num_slots, _, rank = a.shape
    block_m = block_m or _block_m(num_tokens, num_slots)
    num_splits = num_splits or _num_splits(pl.cdiv(num_tokens, block_m), hidden, block_k)
    k_per_split = pl.cdiv(pl.cdiv(hidden, num_splits), block_k) * block_k
    num_splits = pl.cdiv(hidden, k_per_split)  # no split left empty
    item_slot, item_tile, bounds, order = _sort_by_slot(slot_ids, num_slots, block_m)
    kernel = functools.partial(_shrink_kernel, block_m=block_m, block_k=block_k,
                               block_r=_rank_block(rank), k_per_split=k_per_split)
    partials = pl.pallas_call(
        kernel, grid=(item_slot.shape[0], num_splits),
        out_shape=jax.ShapeDtypeStruct((num_splits, num_tokens, rank), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=3),
        interpret=interpret, name="lora_shrink",
    )(item_slot, item_tile, bounds, order, x, a)
    return sum_splits(partials).astype(x.dtype)


def lora_shrink(x, a, slot_ids, *, interpret=False) -> jax.Array:
    """x [T, H] (bf16/fp16/fp32), a [S, H, R] stacked adapters' A (slot 0 all zeros: no adapter),
    slot_ids [T] int32 in [0, S) -> [T, R] in x's dtype: row t is x[t] @ a[slot_ids[t]], fp32
    accumulation. Any R (no padding needed; a multiple of 16 wastes no lanes)."""
    return _shrink(x, a, slot_ids, interpret=interpret)


def _expand_kernel(item_slot_ref, item_tile_ref, bounds_ref, order_ref, y_ref, b_ref, base_ref,
                   out_ref, *, block_m, block_n, block_r):
    """out_ref aliases base_ref [T, N]: the item's rows get base + y @ b[slot] for one N tile."""
    item, n_tile = pl.program_id(0), pl.program_id(1)
    slot = item_slot_ref[item]
    rank, n_dim = b_ref.shape[1], b_ref.shape[2]

    @pl.when(slot > 0)  # slot 0's rows keep base (aliased); padding items (-1) do nothing
    def _():
        in_slot, tokens = _tile_rows(item, item_slot_ref, item_tile_ref, bounds_ref, order_ref,
                                     block_m)
        ranks = jnp.arange(block_r, dtype=jnp.int32)
        rank_ok = ranks < rank
        cols = n_tile * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [Bn]
        mask = in_slot[:, None] & (cols < n_dim)[None, :]  # [Bm, Bn]
        ys = pltriton.load(y_ref.at[tokens[:, None], ranks[None, :]],
                           mask=in_slot[:, None] & rank_ok[None, :], other=0)  # [Bm, Br]
        w = pltriton.load(b_ref.at[slot, ranks[:, None], cols[None, :]],
                          mask=rank_ok[:, None] & (cols < n_dim)[None, :], other=0)  # [Br, Bn]
        dtype = jnp.promote_types(y_ref.dtype, b_ref.dtype)
        delta = pltriton.dot(ys.astype(dtype), w.astype(dtype), precision=_precision(dtype))
        base = pltriton.load(base_ref.at[tokens[:, None], cols[None, :]], mask=mask, other=0)
        pltriton.store(out_ref.at[tokens[:, None], cols[None, :]],
                       (base.astype(jnp.float32) + delta).astype(out_ref.dtype), mask=mask)


def _check_expand(base, y, b, slot_ids) -> None:
    if (base.ndim != 2 or y.ndim != 2 or b.ndim != 3 or y.shape[0] != base.shape[0]
            or b.shape[1:] != (y.shape[1], base.shape[1]) or slot_ids.shape != base.shape[:1]):
        raise ValueError(f"base {base.shape}, y {y.shape}, b {b.shape}, slot_ids "
                         f"{slot_ids.shape}: need base [T, N], y [T, R], b [S, R, N], "
                         f"slot_ids [T]")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "num_warps", "interpret"))
def _expand(base, y, b, slot_ids, *, block_m: int | None = None, block_n: int = 128,
            num_warps: int | None = None, interpret: bool = False):
    _check_expand(base, y, b, slot_ids)
    num_tokens, n_dim = base.shape
    num_slots, rank, _ = b.shape
    block_m = block_m or _block_m(num_tokens, num_slots)
    num_warps = num_warps or (8 if block_m * block_n >= 128 * 128 else 4)
    item_slot, item_tile, bounds, order = _sort_by_slot(slot_ids, num_slots, block_m)
    kernel = functools.partial(_expand_kernel, block_m=block_m, block_n=block_n,
                               block_r=_rank_block(rank))
    return pl.pallas_call(
        kernel, grid=(item_slot.shape[0], pl.cdiv(n_dim, block_n)),
        out_shape=jax.ShapeDtypeStruct(base.shape, base.dtype),
        input_output_aliases={6: 0},  # base
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="lora_expand",
    )(item_slot, item_tile, bounds, order, y, b, base)


def lora_expand(base, y, b, slot_ids, *, interpret=False) -> jax.Array:
    """base [T, N], y [T, R] (lora_shrink's output), b [S, R, N] stacked adapters' B, slot_ids [T]
    -> base + y[t] @ b[slot_ids[t]] in base's dtype, fp32 accumulation. Slot 0's rows are base's
    (its B is never read)."""
    return _expand(base, y, b, slot_ids, interpret=interpret)


def lora_add(base, x, a, b, slot_ids, *, interpret=False) -> jax.Array:
    """base [T, N] + x[t] @ a[slot] @ b[slot] per token: the pair, shrink's partial products
    summed by XLA between them (an expand summing them itself was slower on an H200: its
    programs load every partial in turn)."""
    return lora_expand(base, lora_shrink(x, a, slot_ids, interpret=interpret), b, slot_ids,
                       interpret=interpret)


def lora_add_reference(base, x, a, b, slot_ids) -> jax.Array:
    return lora_expand_reference(base, lora_shrink_reference(x, a, slot_ids), b, slot_ids)
