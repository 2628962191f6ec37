"""Ragged paged attention for prefill on Hopper, through Mosaic GPU: wgmma on the tensor cores,
K/V pages streamed by TMA. Same contract as `ragged_paged_attention` (the shapes and the pure-jnp
`ragged_paged_attention_reference` are in ragged_paged_attention.py, which dispatches prefill
buckets here on a Hopper GPU), for 16-bit q/K/V, head_dim 64 or 128, a query group (q heads
per KV head) of 1, 2, 4 or 8, a block size of 8 or more that divides the KV tile, and neither
sliding window nor soft cap (those take the Triton kernel).

One program: one KV head x one query tile of one sequence. Two compute warpgroups own 64 rows
each: 64 // G of the tile's tokens x the G query heads of the KV head, head-major, so each K/V
tile loaded serves all G heads (GQA). A third warpgroup streams K/V tiles through TMA (one copy
per page the block table names) into a ring of `num_stages` shared-memory slots. The compute
warpgroups take turns on the tensor cores (FlashAttention-3's ping-pong: one runs its softmax
while the other multiplies), so each step ends in a schedule barrier of both.

K/V rows past kv_len in a sequence's last page are read and masked, as FlashAttention's paged
kernels do; they must be finite (the engine zero-initialises its caches). Pages past a
sequence's last are never read: the copy repeats its last page.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

_ROWS = 64  # rows of one compute warpgroup: the wgmma M
_SMEM_BYTES = 227 * 1024  # per block on Hopper
_LOG2E = math.log2(math.e)
# tile metadata columns (one row per query tile, built by `tile_metadata`)
_SEQ, _TOK0, _NTOK, _QPOS0, _KV_LEN = range(5)


def supports(q, k_cache, *, sliding_window=None, soft_cap=None, block_kv: int = 128) -> bool:
    """Whether this kernel takes the call (else the Triton kernel does)."""
    _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    return (q.dtype in (jnp.bfloat16, jnp.float16) and k_cache.dtype == q.dtype
            and head_dim % 64 == 0 and head_dim <= 128 and group in (1, 2, 4, 8)
            and page_size >= 8 and block_kv % page_size == 0
            and sliding_window is None and soft_cap is None)


def count_at_most(ends, values):
    """[V] int32: how many of the sorted `ends` are <= each of `values` (searchsorted, right).
    As one compare-all fusion: jnp's default method is a while loop, a host round trip an
    iteration on the GPU."""
    return jnp.searchsorted(ends, values, side="right", method="compare_all").astype(jnp.int32)


def tile_metadata(cu_q_lens, kv_lens, num_seqs, *, num_tokens: int, tile_tokens: int,
                  max_tiles: int):
    """-> [max_tiles, 5] int32, per query tile: its sequence, first flat token, token count,
    first query position, and the sequence's kv_len. Each live sequence's tokens split into
    tiles of `tile_tokens`; the padding rows [cu_q_lens[num_seqs], num_tokens) follow as tiles
    with kv_len 0 (the kernel writes them zeros); the rest are empty (token count 0). A live
    sequence of kv_len 0 gets no tile: its rows are left unwritten, for another kernel."""
    max_seqs = kv_lens.shape[0]
    live = jnp.arange(max_seqs) < num_seqs[0]
    live_end = cu_q_lens[num_seqs[0]]
    starts = jnp.append(cu_q_lens[:-1], live_end)  # [S + 1]: the padding rows as one more
    keyed = live & (kv_lens > 0)  # a live sequence without keys is another kernel's: no tiles
    lens = jnp.append(jnp.where(keyed, cu_q_lens[1:] - cu_q_lens[:-1], 0), num_tokens - live_end)
    kv = jnp.append(jnp.where(live, kv_lens, 0), 0)
    tiles_per = (lens + tile_tokens - 1) // tile_tokens
    tiles_end = jnp.cumsum(tiles_per)
    tile = jnp.arange(max_tiles, dtype=jnp.int32)
    seq = jnp.minimum(count_at_most(tiles_end, tile), max_seqs)
    first = (tiles_end - tiles_per)[seq] * tile_tokens  # the sequence's first tile, in tokens
    offset = tile * tile_tokens - first
    ntok = jnp.where(tile < tiles_end[-1], jnp.clip(lens[seq] - offset, 0, tile_tokens), 0)
    meta = [jnp.where(seq < max_seqs, seq, 0), starts[seq] + offset, ntok,
            kv[seq] - lens[seq] + offset, kv[seq]]
    return jnp.stack(meta, axis=1).astype(jnp.int32)


def max_tiles(num_tokens: int, max_seqs: int, tile_tokens: int) -> int:
    """Tiles any batch can need: ceil(q_len / tile) over the live sequences and the padding
    rows, at most cdiv(num_tokens, tile) + max_seqs + 1."""
    return pl.cdiv(num_tokens, tile_tokens) + max_seqs + 1


def kv_steps(q0, ntok, kv_len, block_kv: int):
    """-> (KV tiles a run of `ntok` queries from position q0 needs, of which the first
    `full_steps` lie wholly below q0: every row sees every key, no mask). Padding rows (kv_len 0,
    q0 < 0) need none; without the clip at 0 their masked loop would start at tile -1 and wait
    forever for a copy nobody issues."""
    steps = jnp.where((kv_len > 0) & (ntok > 0), pl.cdiv(q0 + ntok, block_kv), 0)
    return steps, jnp.clip((q0 + 1) // block_kv, 0, steps)


def _attention_kernel(meta_ref, block_tables_ref, q_ref, k_ref, v_ref, out_ref, scoped, *,
                      sm_scale, group, block_kv, num_stages):
    (q_smem, rows_smem, k_smem, v_smem), (q_ready, k_ready, v_ready), \
        (k_free, v_free), turn = scoped
    tile, kv_head, wg = lax.axis_index("tile"), lax.axis_index("kv_head"), lax.axis_index("wg")
    seq, tok0, ntok = meta_ref[tile, _SEQ], meta_ref[tile, _TOK0], meta_ref[tile, _NTOK]
    qpos0, kv_len = meta_ref[tile, _QPOS0], meta_ref[tile, _KV_LEN]
    page_size, head_dim = k_ref.shape[2], k_ref.shape[-1]
    tokens_per_wg = _ROWS // group
    # KV tiles the whole program needs: up to its last token's position (0 for padding rows)
    num_steps, _ = kv_steps(qpos0, ntok, kv_len, block_kv)

    def take_turn():  # both compute warpgroups meet here; see the module docstring
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when((ntok > 0) & (wg < 2))
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        first_tok = wg * tokens_per_wg  # this warpgroup's tokens within the tile
        my_ntok = jnp.clip(ntok - first_tok, 0, tokens_per_wg)
        my_q0 = qpos0 + first_tok
        my_steps, full_steps = kv_steps(my_q0, my_ntok, kv_len, block_kv)
        # Q arrives in (and O leaves from) an untiled buffer: TMA into a swizzled one needs
        # tile-aligned token offsets, and a sequence's tokens start anywhere. wgmma reads Q from
        # the swizzled copy. Rows are indexed with proven multiples (`_aligned`).
        my_rows = pl.ds(_aligned(wg * _ROWS, _ROWS), _ROWS)
        q_rows, staged_rows = q_smem.at[my_rows], rows_smem.at[my_rows]

        @pl.when(my_steps > 0)
        def _():
            for h in range(group):  # rows [h * tokens, (h + 1) * tokens): query head h of the group
                plgpu.copy_gmem_to_smem(
                    q_ref.at[pl.ds(tok0 + first_tok, tokens_per_wg), kv_head * group + h],
                    staged_rows.at[pl.ds(h * tokens_per_wg, tokens_per_wg)], q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            q_rows[...] = staged_rows[...]
            plgpu.commit_smem()
            plgpu.barrier_wait(k_ready.at[0])

        m = plgpu.layout_cast(jnp.full((_ROWS,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.full((_ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        pl.when(wg == 1)(take_turn)  # warpgroup 1 starts half a step behind

        def step(j, carry, *, masked):
            acc, m, l = carry
            slot = lax.rem(j, num_stages)

            def scores(s_ref):
                plgpu.wgmma(s_ref, q_rows, _slot_rows(k_smem, slot, block_kv).transpose((1, 0)))
                take_turn()
                return s_ref[...]
            s = pl.run_scoped(scores, plgpu.ACC((_ROWS, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = s * (sm_scale * _LOG2E)  # base 2 from here on
            if masked:
                row = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                q_pos = my_q0 + lax.rem(row, tokens_per_wg)  # head-major rows
                s = jnp.where(col + j * block_kv <= q_pos, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha + p.sum(axis=1)
            p16 = p.astype(v_smem.dtype)
            # the softmax done, hand the tensor cores over before waiting for V
            acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)

            def values(acc_ref):
                plgpu.wgmma(acc_ref, p16, _slot_rows(v_smem, slot, block_kv))

                @pl.when(j + 1 < my_steps)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(j + 1, num_stages)])
            acc = pl.run_state(values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(full_steps, my_steps, functools.partial(step, masked=True), carry)

        @pl.loop(my_steps, num_steps)
        def _(j):  # tiles only the other warpgroup needs: free them, keep the turns in step
            slot = lax.rem(j, num_stages)
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            take_turn()
            take_turn()
        pl.when(wg == 0)(take_turn)

        # rows with no key (padding tiles) have l = 0 and acc = 0: they store zeros
        inv_l = 1.0 / jnp.maximum(l, 1e-30)
        staged_rows[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(q_rows.dtype)
        plgpu.commit_smem()
        _store_rows(staged_rows, out_ref, tok0 + first_tok, my_ntok, kv_head, group, tokens_per_wg)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when((ntok > 0) & (wg == 2))
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        pages_per_tile = block_kv // page_size
        last_page = jnp.maximum(pl.cdiv(kv_len, page_size) - 1, 0)

        def fetch(j, slot, cache_ref, smem, ready):
            for c in range(pages_per_tile):
                idx = jnp.minimum(j * pages_per_tile + c, last_page)
                page = block_tables_ref[seq, idx]
                rows = pl.ds(_aligned(slot * block_kv + c * page_size, page_size), page_size)
                plgpu.copy_gmem_to_smem(cache_ref.at[page, kv_head],
                                        smem.at[rows],
                                        ready.at[slot])

        for i in range(num_stages):
            @pl.when(i < num_steps)
            def _():
                fetch(i, i, k_ref, k_smem, k_ready)
                fetch(i, i, v_ref, v_smem, v_ready)

        @pl.loop(num_stages, jnp.maximum(num_steps, num_stages))
        def _(j):
            slot = lax.rem(j, num_stages)
            plgpu.barrier_wait(k_free.at[slot])
            fetch(j, slot, k_ref, k_smem, k_ready)
            plgpu.barrier_wait(v_free.at[slot])
            fetch(j, slot, v_ref, v_smem, v_ready)


def _aligned(offset, multiple: int):
    """A row offset the layout inference can prove is a multiple of `multiple` (of the tile)."""
    return offset if isinstance(offset, int) else pl.multiple_of(offset, multiple)


def _slot_rows(smem, slot, block_kv):
    """The [block_kv, D] rows of ring slot `slot` of a [num_stages * block_kv, D] buffer."""
    return smem.at[pl.ds(_aligned(slot * block_kv, block_kv), block_kv)]


def _store_rows(o_rows, out_ref, tok0, ntok, kv_head, group, tokens_per_wg):
    """Stores the first `ntok` tokens of each head's rows of o_rows [64, D] (head-major) to
    out_ref [T, Hq, D]. TMA boxes have static sizes, so a ladder of power-of-two boxes covers
    any count (ntok = 11: 8 + 2 + 1)."""
    for h in range(group):
        done = jnp.int32(0)
        size = tokens_per_wg
        while size:
            @pl.when((ntok & size) != 0)
            def _(size=size, done=done):
                plgpu.copy_smem_to_gmem(
                    o_rows.at[pl.ds(h * tokens_per_wg + done, size)],
                    out_ref.at[pl.ds(tok0 + done, size), kv_head * group + h])
            done = done + (ntok & size)
            size //= 2


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_kv", "num_stages",
                                             "max_keyed_seqs"))
def ragged_paged_attention_mgpu(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                                *, sm_scale: float, block_kv: int = 128,
                                num_stages: int = 2, max_keyed_seqs: int | None = None):
    """The Mosaic GPU kernel (Hopper); the contract of `ragged_paged_attention`, within
    `supports`. Padding rows (past cu_q_lens[num_seqs]) come back zero. max_keyed_seqs: the
    most live sequences with keys (kv_len > 0) a call has, if fewer than the batch's slots; the
    grid then holds that many sequences' tiles (an empty program still claims a GPU's shared
    memory for its turn)."""
    if not supports(q, k_cache, block_kv=block_kv):
        raise ValueError(f"ragged_paged_attention_mgpu: unsupported q {q.shape} {q.dtype}, "
                         f"cache {k_cache.shape} {k_cache.dtype}, block_kv={block_kv}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_cache.shape
    smem_bytes = (2 * 2 * _ROWS + 2 * num_stages * block_kv) * head_dim * q.dtype.itemsize
    if smem_bytes > _SMEM_BYTES:
        raise ValueError(f"block_kv={block_kv} x num_stages={num_stages} needs {smem_bytes} bytes "
                         f"of shared memory; the H200 has {_SMEM_BYTES}")
    group = num_q_heads // num_kv_heads
    tile_tokens = 2 * (_ROWS // group)
    num_tiles = max_tiles(num_tokens, max_keyed_seqs or block_tables.shape[0], tile_tokens)
    meta = tile_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens=num_tokens,
                         tile_tokens=tile_tokens, max_tiles=num_tiles)
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kv_tile = plgpu.SMEM((num_stages * block_kv, head_dim), k_cache.dtype, transforms=swizzled)
    scratch = (
        (plgpu.SMEM((2 * _ROWS, head_dim), q.dtype, transforms=swizzled),
         plgpu.SMEM((2 * _ROWS, head_dim), q.dtype),  # untiled: row slices at any offset
         kv_tile, kv_tile),
        (plgpu.Barrier(num_arrivals=group, num_barriers=2),
         plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=num_stages),
         plgpu.Barrier(num_arrivals=block_kv // page_size, num_barriers=num_stages)),
        (plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),) * 2,
        plgpu.Barrier(num_arrivals=2),
    )
    kernel = functools.partial(_attention_kernel, sm_scale=sm_scale, group=group,
                               block_kv=block_kv, num_stages=num_stages)

    def entry(meta_ref, tables_ref, q_ref, k_ref, v_ref, out_ref):
        pl.run_scoped(lambda *s: kernel(meta_ref, tables_ref, q_ref, k_ref, v_ref, out_ref, s),
                      *scratch, collective_axes="wg")

    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(num_tiles, num_kv_heads), grid_names=("tile", "kv_head"),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(meta, block_tables, q, k_cache, v_cache)
