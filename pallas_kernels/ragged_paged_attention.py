"""Ragged paged attention: the queries of all scheduled tokens of all sequences, flattened, attend
causally to each sequence's K/V, which live in fixed-size pages named by a block table.

Shapes (letters as in the einsums):
  q            [T, Hq, D]                 t: token, h = k*g: query head, d: head dim
  k_cache      [N, Hkv, P, D]             N: pages (blocks), k: KV head, p: page size (block_size)
  v_cache      [N, Hkv, P, D]             head-major: a page's tokens of one KV head contiguous,
                                          what one (sequence, KV head) program reads
  kv_lens      [S] int32                  KV length of each sequence, this step's tokens included
  block_tables [S, B] int32               B: max pages per sequence
  cu_q_lens    [S + 1] int32              query start of each sequence in the flat batch
  num_seqs     [1] int32                  live sequences; the rest are padding (q_len 0)
Query i of sequence s sits at position kv_lens[s] - q_len[s] + i and sees KV positions <= its own.
Rows past cu_q_lens[num_seqs] are padding: their output is unspecified (finite).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import ptx
from pallas_kernels import ragged_paged_attention_mgpu as mgpu
from pallas_kernels.kv_write import float8_as_bits_on_cpu

_MASK_INIT = -1e30
# A float8 cache's prefill sequences a bucket stages for the Mosaic kernel at most (the rest take
# the Triton kernel): its grid holds their tiles, and a program without a tile still takes an
# SM's shared memory for its turn.
_MAX_STAGED_SEQS = 16
# V's int16 words, two at a time (one 32-bit register, bytes b0..b3: even d, odd d of the first
# word, then of the second) -> the even values (b0, b2; selector 0x5420) or the odd (b1, b3;
# 0x5431) as an fp16 pair: a byte permute and sm_89's float8 pair conversion (Triton's 16-bit
# integer ops took ~6 instructions a word).
_V_PAIRS_PTX = """{{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $1, 0, {};
mov.b32 {{lo, hi}}, t;
cvt.rn.f16x2.e4m3x2 $0, lo;
}}"""
# Pallas's Triton lowering offsets arrays of up to 4 GiB with signed 32-bit integers, so a 1-byte
# (float8) cache array larger than this would be read at wrapped addresses (2 to 4 GiB).
MAX_1BYTE_CACHE_BYTES = 2**31


def ragged_paged_attention_reference(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens,
                                     num_seqs, *, sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None, k_scale: float = 1.0,
                                     v_scale: float = 1.0):
    """Pure jnp, fixed shapes (jittable): an online softmax looped over the page slots that the
    longest live sequence uses (a while loop, so short contexts cost little under a long
    max_model_len). Costs T * P per page slot: the XLA fallback and the tests' reference.
    k_scale, v_scale: the cache's static per-tensor scales (a float8 cache holds K / k_scale).
    """
    attend = functools.partial(_attend_reference, kv_lens=kv_lens, block_tables=block_tables,
                               cu_q_lens=cu_q_lens, num_seqs=num_seqs, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale,
                               v_scale=v_scale)
    # XLA's CPU backend widens a float8 array that a loop reads to float16, the whole cache each
    # call: there the loop reads the cache's bits, as uint8, and widens only the pages it gathers.
    return float8_as_bits_on_cpu(k_cache.dtype, attend, functools.partial(attend, as_bits=True),
                                 q, k_cache, v_cache)


def _attend_reference(q, k_cache, v_cache, *, kv_lens, block_tables, cu_q_lens, num_seqs,
                      sm_scale, sliding_window, soft_cap, k_scale, v_scale, as_bits=False):
    num_tokens, num_q_heads, head_dim = q.shape
    cache_dtype = k_cache.dtype
    if as_bits:
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, jnp.uint8) for c in (k_cache, v_cache))
    _, num_kv_heads, page_size, _ = k_cache.shape
    max_seqs, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    token, seq, q_lens = _token_seqs(cu_q_lens, num_tokens)
    kv_len = kv_lens[seq]  # [T]
    q_pos = kv_len - q_lens[seq] + token - cu_q_lens[seq]  # [T]
    live = token < cu_q_lens[num_seqs[0]]
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale

    def page_step(j, carry):
        m, l, acc = carry
        page = block_tables[seq, j]  # [T]
        k = _gathered(k_cache[page], cache_dtype) * k_scale  # [T, Hkv, P, D]
        v = _gathered(v_cache[page], cache_dtype) * v_scale
        s = jnp.einsum("tkgd,tkpd->tkgp", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [P]
        mask = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < kv_len[:, None])
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        mask = (mask & live[:, None])[:, None, None, :]  # [T, 1, 1, P]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MASK_INIT), axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgp,tkpd->tkgd", p, v)
        return m_new, l, acc

    init = (jnp.full((num_tokens, num_kv_heads, group), _MASK_INIT, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    num_pages = jnp.minimum((jnp.max(kv_lens) + page_size - 1) // page_size, max_pages)
    _, l, acc = jax.lax.fori_loop(0, num_pages, page_step, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _gathered(pages: jax.Array, cache_dtype) -> jax.Array:
    """Gathered pages as float32, from the cache's own dtype or its bits."""
    if pages.dtype != cache_dtype:
        pages = jax.lax.bitcast_convert_type(pages, cache_dtype)
    return pages.astype(jnp.float32)


# ---------------------------------------------------------------------------------------------
# Pallas (Triton) kernel. One program: one KV head x one block of up to `block_q` query tokens of
# one sequence x one KV split. Its rows are (token, query head of the group) pairs, the group
# padded to a power of two, so every K/V tile loaded serves all query heads of the group (GQA).
# K/V rows are gathered through the block table (one page id a tile where the tile lies in one
# page, else one a token), so any page size and tile size mix. The KV tiles below a block's
# first query run without masks; the diagonal and tail tiles (all tiles under a sliding
# window) take the mask.
# ---------------------------------------------------------------------------------------------

# Off a GPU (interpret mode, CUDA lowering on a CPU machine) the split heuristic sizes for a
# Hopper's SM count, so those runs take the paths the GPU takes.
_HOPPER_NUM_SMS = 132
_LOG2E = 1.4426950408889634


def _num_sms() -> int:
    """Streaming multiprocessors of the GPU: only sizes the split-KV heuristic."""
    return getattr(jax.devices()[0], "core_count", None) or _HOPPER_NUM_SMS


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fp8_pairs_to_f16(words, interpret):
    """words [.., n] int16, each two float8_e4m3fn values (d = 2i low byte, 2i + 1 high) -> the
    even and the odd values [.., n] as float16 (exact: every float8_e4m3fn value is one)."""
    if interpret:
        byte = lambda w: jax.lax.bitcast_convert_type((w & 0xFF).astype(jnp.uint8),
                                                      jnp.float8_e4m3fn).astype(jnp.float16)
        return byte(words), byte(words >> 8)
    f16 = jax.ShapeDtypeStruct(words.shape, jnp.float16)
    # one asm a result: Pallas lowers only single-result inline asm
    return tuple(pltriton.elementwise_inline_asm(
        _V_PAIRS_PTX.format(selector), args=[words], constraints="=r,r", pack=2,
        result_shape_dtypes=[f16])[0] for selector in ("0x5420", "0x5431"))


def _attention_kernel(seq_starts_ref, cu_q_lens_ref, kv_lens_ref, block_tables_ref, num_seqs_ref,
                      q_ref, k_ref, v_ref, *refs, num_splits, loop_q_blocks, **static):
    o_ref, lse_ref = (refs[-2], refs[-1]) if num_splits > 1 else (refs[-1], None)
    attend = functools.partial(_attend, seq_starts_ref=seq_starts_ref, cu_q_lens_ref=cu_q_lens_ref,
                               kv_lens_ref=kv_lens_ref, block_tables_ref=block_tables_ref,
                               num_seqs_ref=num_seqs_ref, q_ref=q_ref, k_ref=k_ref, v_ref=v_ref,
                               o_ref=o_ref, lse_ref=lse_ref, kv_head=pl.program_id(1),
                               split=pl.program_id(2), num_splits=num_splits, **static)
    if not loop_q_blocks:
        return attend(pl.program_id(0))
    # Fewer programs than q blocks: program p takes blocks p, p + programs, ... below the end
    # of the last block with work (refs[0]), so a launch with none costs a load a program.
    first, programs = pl.program_id(0), pl.num_programs(0)

    def block(i, carry):
        attend(first + i * programs)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(refs[0][0] - first, 0), programs), block, 0)


def _attend(pid, *, seq_starts_ref, cu_q_lens_ref, kv_lens_ref, block_tables_ref, num_seqs_ref,
            q_ref, k_ref, v_ref, o_ref, lse_ref, kv_head, split, sm_scale, sliding_window,
            soft_cap, group, group_pad, block_q, block_k, page_size, num_kv_heads, num_splits,
            num_sms, k_scale, v_scale, only, interpret):
    """The kernel's work for q block `pid` (all of it, for one KV head and split)."""
    # The q blocks of sequence s start at cu_q_lens[s] // block_q + s, so a sequence of q_len 0
    # owns one block that exits at once, and cdiv(T, block_q) + S blocks cover any batch.
    seq = jnp.sum((seq_starts_ref[...] <= pid).astype(jnp.int32)) - 1
    q_start, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    block_start = q_start + (pid - seq_starts_ref[seq]) * block_q

    # a sequence given no keys (kv_len 0) is another kernel's: its rows are left as they are
    runs = (block_start < q_end) & (seq < num_seqs_ref[0]) & (kv_lens_ref[seq] > 0)
    if only is not None:  # one kind of sequence: decodes (q_len 1) or the rest
        runs &= (q_end - q_start == 1) == (only == "decode")

    @pl.when(runs)
    def _():
        kv_len = kv_lens_ref[seq]
        rows = jnp.arange(block_q * group_pad, dtype=jnp.int32)
        token = block_start + rows // group_pad  # [R]
        head = kv_head * group + rows % group_pad  # [R]
        row_valid = (token < q_end) & (rows % group_pad < group)
        q_pos = kv_len - (q_end - q_start) + token - q_start  # [R]
        # Every index an array (broadcast to the loaded shape): Triton gathers, interpret agrees.
        dims = jnp.arange(q_ref.shape[-1], dtype=jnp.int32)[None, :]  # [1, D]
        # V as int16 pairs of float8 values: its dot's operand is then a 16-bit tile, which the
        # GPU transposes on its way from shared memory (a float8 one it gathers byte by byte);
        # the dot runs on the even and the odd dims apart
        v_pairs = v_ref.dtype == jnp.int16
        v_cols = jnp.arange(v_ref.shape[-1], dtype=jnp.int32)[None, :]  # [1, D], D / 2 if pairs
        out_dims = (2 * v_cols, 2 * v_cols + 1) if v_pairs else (v_cols,)
        q = pltriton.load(q_ref.at[token[:, None], head[:, None], dims], mask=row_valid[:, None],
                          other=0)  # [R, D]
        scaled_q = k_ref.dtype == jnp.float8_e4m3fn and q.dtype.itemsize == 2
        if scaled_q:
            # float8 pages widen to float16 in one instruction per pair on sm_90 (to bf16 it
            # takes several), so the dots run in float16; q, scaled first, is well in its range
            q = (q.astype(jnp.float32) * sm_scale).astype(jnp.float16)

        first_pos = kv_len - (q_end - q_start) + block_start - q_start
        kv_hi = kv_len - (q_end - q_start) + jnp.minimum(block_start + block_q, q_end) - q_start
        kv_lo = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0)
        tile_lo, tile_hi = kv_lo // block_k, pl.cdiv(kv_hi, block_k)
        # Splits in use this step, from the live batch; the grid holds the most a bucket can use
        # and the splits past these find an empty range.
        live_programs = jnp.maximum(num_seqs_ref[0], pl.cdiv(cu_q_lens_ref[num_seqs_ref[0]],
                                                             block_q)) * num_kv_heads
        splits_used = jnp.clip(pl.cdiv(2 * num_sms, live_programs), 1, num_splits)
        per_split = pl.cdiv(tile_hi - tile_lo, splits_used)
        t0 = tile_lo + split * per_split
        t1 = jnp.minimum(t0 + per_split, tile_hi)
        dot_precision = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                         else jax.lax.Precision.DEFAULT)
        # Base-2 softmax (ptx.exp2 is one instruction); without a soft cap the scale and log2(e)
        # fold into one multiply of the scores (sm_scale not again where q carries it).
        q_scale = 1.0 if scaled_q else sm_scale
        qk_scale = (q_scale * _LOG2E if soft_cap is None else q_scale / soft_cap) * k_scale

        # Row (page * Hkv + kv_head) * P + offset of the flat cache holds the KV head's token
        # `offset` of `page`: page * page_rows plus a part the same in every tile, hoisted.
        page_rows = num_kv_heads * page_size
        in_page = kv_head * page_size + jnp.arange(block_k, dtype=jnp.int32) % page_size  # [Bk]

        def tile_rows(t, kv_pos, kv_valid):
            """[Bk] rows of the flat cache holding KV positions kv_pos [Bk] of tile t."""
            if page_size % block_k == 0:  # the tile lies in one page: one page id, in range
                page = block_tables_ref[seq, t * block_k // page_size]
                return page * page_rows + t * block_k % page_size + in_page
            # Several pages a tile (block_k a multiple of P): per-token ids (a [Bk] gather of
            # Bk / P distinct words that L1 broadcasts; a per-page load would need a reshape
            # that costs a layout change).
            page = pltriton.load(block_tables_ref.at[seq, kv_pos // page_size], mask=kv_valid,
                                 other=None if kv_valid is None else 0)
            return page * page_rows + in_page

        def tile_step(t, carry, *, masked):
            """One KV tile. Unmasked tiles lie wholly below the block's first query position
            (so below kv_len): every row sees every key, and loads and scores skip all masks."""
            m, l, acc = carry
            kv_pos = t * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [Bk]
            kv_valid = kv_pos < kv_hi if masked else None
            # dims (an arange) last and unit-stride: Triton vectorises the loads along D
            kv_rows = tile_rows(t, kv_pos, kv_valid)[:, None]
            load = lambda ref, cols, zero: pltriton.load(
                ref.at[kv_rows, cols], mask=kv_valid[:, None] if masked else None,
                other=zero if masked else None)
            # a float8 cache is widened to the dots' dtype in registers (its scales fold into
            # qk_scale and the output)
            k = load(k_ref, dims, 0.0).astype(q.dtype)  # [Bk, D]
            v = load(v_ref, v_cols, 0 if v_pairs else 0.0)
            v_parts = (_fp8_pairs_to_f16(v, interpret) if v_pairs
                       else (v.astype(q.dtype),))  # [Bk, D or D/2]
            s = pltriton.dot(q, k, trans_b=True, precision=dot_precision) * qk_scale  # [R, Bk]
            if soft_cap is not None:
                s = (soft_cap * _LOG2E) * jnp.tanh(s)
            if masked:
                mask = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
                if sliding_window is not None:
                    mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
                s = jnp.where(mask, s, _MASK_INIT)
            # A row that has seen no key yet gets p = exp2(0) = 1 on masked keys, but its m is
            # still _MASK_INIT, so alpha = 0 at its first visible key erases them; in a split
            # where it sees none, its lse ~ _MASK_INIT gives that split weight 0 in the merge.
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = ptx.exp2(s - m_new[:, None], interpret)
            alpha = ptx.exp2(m - m_new, interpret)
            acc = tuple(a * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v,
                                                          precision=dot_precision)
                        for a, v in zip(acc, v_parts))
            return m_new, l * alpha + jnp.sum(p, axis=1), acc

        num_rows = q.shape[0]
        carry = (jnp.full((num_rows,), _MASK_INIT, jnp.float32),
                 jnp.zeros((num_rows,), jnp.float32),
                 tuple(jnp.zeros((num_rows, d.shape[1]), jnp.float32) for d in out_dims))
        # The split's tiles [t0, t1) in two runs: those every row sees whole (below first_pos),
        # then the diagonal / tail tiles. A window masks from below too: all tiles take the mask.
        t_masked = t0
        if sliding_window is None:
            t_masked = jnp.clip(first_pos // block_k, t0, t1)
            carry = jax.lax.fori_loop(t0, t_masked, functools.partial(tile_step, masked=False),
                                      carry)
        m, l, acc = jax.lax.fori_loop(t_masked, t1, functools.partial(tile_step, masked=True),
                                      carry)
        out_scale = v_scale / jnp.maximum(l, 1e-30)
        # each split leaves its normalised output and base-2 log-sum-exp (-inf when empty)
        at = () if num_splits == 1 else (split,)
        for a, d in zip(acc, out_dims):
            pltriton.store(o_ref.at[(*at, token[:, None], head[:, None], d)],
                           (a * out_scale[:, None]).astype(o_ref.dtype), mask=row_valid[:, None])
        if num_splits > 1:
            pltriton.store(lse_ref.at[split, token, head], m + jnp.log2(l), mask=row_valid)


def _merge_splits(o_split, lse_split):
    """o_split [K, T, Hq, D] f32 normalised per split, lse_split [K, T, Hq] base 2 -> [T, Hq, D].
    Written over the K splits one by one (K is static and small), elementwise only, so that XLA
    makes one kernel of it (reductions over K split it into two launch-bound ones)."""
    splits = range(lse_split.shape[0])
    lse_max = functools.reduce(jnp.maximum, (lse_split[k] for k in splits))  # [T, Hq]
    weight = [jnp.exp2(lse_split[k] - lse_max) for k in splits]  # 0 for empty splits
    merged = functools.reduce(jnp.add, (w[..., None] * o_split[k] for k, w in zip(splits, weight)))
    return merged / functools.reduce(jnp.add, weight)[..., None]


def _fills_gpu(num_tokens, max_seqs, block_q, num_kv_heads) -> bool:
    """Whether the bucket's (sequence, head) programs can fill the GPU without KV splits."""
    return max(max_seqs, pl.cdiv(num_tokens, block_q)) * num_kv_heads >= _num_sms()


def _default_num_splits(num_tokens, max_seqs, block_q, num_kv_heads, num_tiles) -> int:
    """Split KV only when too few (sequence, head) programs could fill the GPU: few long decodes.
    The most splits one live sequence would take; the kernel uses fewer when more are live."""
    if _fills_gpu(num_tokens, max_seqs, block_q, num_kv_heads):
        return 1
    return max(1, min(pl.cdiv(2 * _num_sms(), num_kv_heads), num_tiles // 4))


def _is_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs):
    _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, kv_head_dim = k_cache.shape
    max_seqs = block_tables.shape[0]
    if k_cache.shape != v_cache.shape or kv_head_dim != head_dim:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must be "
                         f"[num_blocks, num_kv_heads, block_size, head_dim={head_dim}]")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of "
                         f"num_kv_heads={num_kv_heads}")
    if head_dim not in (32, 64, 128, 256):
        raise ValueError(f"head_dim={head_dim} must be one of 32, 64, 128, 256")
    if k_cache.dtype.itemsize == 1 and MAX_1BYTE_CACHE_BYTES < k_cache.size <= 2**32:
        raise ValueError(f"A 1-byte KV cache array of {k_cache.size} bytes is not addressable "
                         f"by the Triton kernel: at most 2 GiB (2**31 bytes), or over 4 GiB")
    if kv_lens.shape != (max_seqs,) or cu_q_lens.shape != (max_seqs + 1,) or num_seqs.shape != (1,):
        raise ValueError(f"kv_lens {kv_lens.shape}, cu_q_lens {cu_q_lens.shape}, num_seqs "
                         f"{num_seqs.shape} must be [{max_seqs}], [{max_seqs + 1}], [1]")


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "interpret", "block_q", "block_k", "num_kv_splits",
    "num_warps", "num_stages", "implementation", "k_scale", "v_scale"))
def ragged_paged_attention(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0, interpret: bool = False,
                           block_q: int | None = None, block_k: int | None = None,
                           num_kv_splits: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, implementation: str | None = None):
    """The Pallas kernel; same contract as `ragged_paged_attention_reference` (module docstring).

    Tiles (all optional, static): `block_q` query tokens per program (a power of two; the rows of
    a program are block_q x the group padded to a power of two), `block_k` KV tokens per tile,
    `num_kv_splits` the most KV splits, merged exactly afterwards (flash-decoding; default: only
    for buckets where fewer programs than SMs may run; each step uses as many as its live
    sequences need to fill the GPU).
    `implementation`: "triton" (this kernel), "mosaic" (ragged_paged_attention_mgpu.py: wgmma
    and TMA on Hopper, the faster prefill, docs/benchmarks.md) or None: Mosaic for prefill
    buckets (more tokens than sequences) on a Hopper GPU where it supports the call and no
    Triton tile is given, else Triton.
    Padding rows (past cu_q_lens[num_seqs]) come back zero. On a float8_e4m3fn cache (scales
    k_scale, v_scale) the Mosaic kernel, which reads 16-bit pages, takes the prefill through
    16-bit copies of its prefill sequences' pages (`_staged_mosaic`), and the decodes take the
    Triton kernel.
    """
    _check_shapes(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    max_seqs = block_tables.shape[0]
    if implementation not in (None, "triton", "mosaic"):
        raise ValueError(f"implementation={implementation!r} must be None, 'triton' or 'mosaic'")
    fp8_pages = k_cache.dtype == jnp.float8_e4m3fn
    # a float8 cache reaches the Mosaic kernel through 16-bit copies of its prefill pages
    mosaic_pages = jax.ShapeDtypeStruct(k_cache.shape, q.dtype) if fp8_pages else k_cache
    supported = (mgpu.supports(q, mosaic_pages, sliding_window=sliding_window, soft_cap=soft_cap)
                 and (fp8_pages or (k_scale, v_scale) == (1.0, 1.0)))
    if implementation == "mosaic" and not supported:
        raise ValueError("implementation='mosaic' takes 16-bit q, 16-bit or float8 K/V, head_dim "
                         "64 or 128, a query group of 1, 2, 4 or 8, a block_size of 8, 16, 32, 64 "
                         "or 128, KV scales only on a float8 cache and no sliding window or soft "
                         f"cap; got q {q.shape} {q.dtype}, k_cache {k_cache.shape} "
                         f"{k_cache.dtype}")
    triton_tiles = (block_q, block_k, num_kv_splits, num_warps, num_stages) != (None,) * 5
    auto_mosaic = (implementation is None and supported and not interpret and not triton_tiles
                   and q.shape[0] > max_seqs and _is_hopper())
    args = (q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
              interpret=interpret, k_scale=k_scale, v_scale=v_scale)
    if implementation == "mosaic" or auto_mosaic:
        if fp8_pages:
            return _staged_mosaic(*args, **kw)
        return mgpu.ragged_paged_attention_mgpu(*args, sm_scale=sm_scale)
    if not triton_tiles and fp8_pages and q.shape[0] > max_seqs:
        # A prefill bucket's decodes launch apart, at the decode tiling: on float8 pages it
        # reads them faster than the prefill tiling (experiments/fp8_kv_attention_gpu.py).
        return _triton_attention(*args, only="prefill", **kw,
                                 out=_triton_attention(*args, only="decode", **kw))
    return _triton_attention(*args, block_q=block_q, block_k=block_k,
                             num_kv_splits=num_kv_splits, num_warps=num_warps,
                             num_stages=num_stages, **kw)


def _staged_mosaic(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                   sm_scale, k_scale, v_scale, **triton_kw):
    """A float8 cache's bucket with the prefill on the Mosaic kernel: its sequences' pages
    staged in 16 bits while they fit twice the bucket's tokens of pages and _MAX_STAGED_SEQS
    sequences (their K as float8 values, exact in 16 bits, k_scale folded into the scores; V
    times v_scale); the prefill sequences past that, then the decodes, on the Triton kernel,
    each writing its own rows."""
    num_staged = min(k_cache.shape[0], 2 * pl.cdiv(q.shape[0], k_cache.shape[2]))
    max_staged_seqs = min(_MAX_STAGED_SEQS, block_tables.shape[0])
    k16, v16, tables, staged_kv_lens, rest_kv_lens = _stage_prefill_pages(
        k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, dtype=q.dtype,
        v_scale=v_scale, num_staged=num_staged, max_staged_seqs=max_staged_seqs)
    out = mgpu.ragged_paged_attention_mgpu(q, k16, v16, staged_kv_lens, tables, cu_q_lens,
                                           num_seqs, sm_scale=sm_scale * k_scale,
                                           max_keyed_seqs=max_staged_seqs)
    kw = dict(triton_kw, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)
    # The prefill past the staged pages is rare: its launch takes as many programs as the GPU
    # holds at once (two an SM at the prefill tiling), not one a q block, mostly idle.
    out = _triton_attention(q, k_cache, v_cache, rest_kv_lens, block_tables, cu_q_lens,
                            num_seqs, only="prefill", out=out, **kw,
                            q_block_programs=pl.cdiv(2 * _num_sms(), k_cache.shape[1]))
    return _triton_attention(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
                             only="decode", out=out, **kw)


def _stage_prefill_pages(k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                         dtype, v_scale: float, num_staged: int, max_staged_seqs: int):
    """The pages of the prefill sequences (q_len > 1), in batch order while they fit
    `num_staged` pages and `max_staged_seqs` sequences, copied from a float8 cache in `dtype`:
    (k, v [num_staged, Hkv, P, D] (v times v_scale), their block tables [S, B], kv_lens of the
    staged sequences and of the others [S], each 0 where the other holds the sequence). Slots
    past the staged pages copy page 0 (finite, never read)."""
    page_size = k_cache.shape[2]
    max_seqs, max_pages = block_tables.shape
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    prefill = (jnp.arange(max_seqs) < num_seqs[0]) & (q_lens > 1)
    pages = jnp.where(prefill, pl.cdiv(kv_lens, page_size), 0)  # [S]
    end = jnp.cumsum(pages)
    start = end - pages
    # end and the count grow: the staged sequences are a prefix of the prefill ones
    staged = prefill & (end <= num_staged) & (jnp.cumsum(prefill) <= max_staged_seqs)
    slot = jnp.arange(num_staged, dtype=jnp.int32)
    seq = jnp.minimum(mgpu.count_at_most(end, slot), max_seqs - 1)  # [num_staged]
    used = slot < jnp.sum(jnp.where(staged, pages, 0))
    page = block_tables[seq, jnp.clip(slot - start[seq], 0, max_pages - 1)]
    # the page ids once: fused into the copy, XLA would recompute them for every element
    src = jax.lax.optimization_barrier(jnp.where(used, page, 0))
    k = k_cache[src].astype(dtype)
    v = (v_cache[src].astype(jnp.float32) * v_scale).astype(dtype)
    tables = jnp.minimum(start[:, None] + jnp.arange(max_pages)[None, :], num_staged - 1)
    return (k, v, tables.astype(jnp.int32), jnp.where(staged, kv_lens, 0),
            jnp.where(staged, 0, kv_lens))


def _triton_attention(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                      sm_scale, sliding_window=None, soft_cap=None, interpret=False, block_q=None,
                      block_k=None, num_kv_splits=None, num_warps=None, num_stages=None,
                      fill_value: float | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0, v_pairs: bool | None = None,
                      only: str | None = None, out: jax.Array | None = None,
                      q_block_programs: int | None = None):
    """The Triton kernel, traced inside a jit. Its output starts as `fill_value` (default 0),
    which is what rows it does not write (padding) hold; the tests and the GPU check pass NaN,
    so that an element it should have written and did not shows. The KV splits' partial
    outputs start as fill_value when one is given, else uninitialised (no fill kernel): the
    kernel writes every split of every row the merge keeps. v_pairs: read float8 V pages as
    int16 pairs (the kernel's v_pairs; default: in decode buckets without KV splits, where q is
    16-bit: benchmarks/experiments/fp8_kv_attention_gpu.py).
    only: "decode" (sequences of q_len 1, at the decode bucket's tiling) or "prefill" (the
    others): the rows of the other kind come from `out` (else `fill_value`).
    q_block_programs: launch that many programs along the q blocks, each looping over its share
    of the blocks with work (default: a program a block)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_cache.shape
    max_seqs, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    group_pad = _next_pow2(group)
    decode_bucket = num_tokens <= max_seqs if only is None else only == "decode"
    if block_q is None:  # decode: the fewest rows a tensor-core dot takes; prefill: 64 rows
        block_q = max(1, (16 if decode_bucket else 64) // group_pad)
    # The tiling sweeps (`python -m pallas_kernels.bench --sections sweep`, docs/lab/): 16-bit
    # decode reads 128-token KV tiles best (8 warps and 3 stages without splits, 4 and 2 with),
    # prefill 64-token tiles with 2 stages. Wider tiles of fp32 or head_dim 256 would not fit
    # shared memory at those depths. Float8 pages (V as int16 pairs) read fastest in 128-token
    # tiles too, at 4 warps and 3 stages; with KV splits (V read as float8, not pairs: 255
    # registers at 128 tokens) in 64-token tiles (benchmarks/experiments/fp8_kv_attention_gpu.py,
    # ncu_kernels.py).
    fp8_pages = k_cache.dtype == jnp.float8_e4m3fn
    decode_16bit = decode_bucket and q.dtype.itemsize <= 2 and head_dim <= 128
    fp8_split_decode = (fp8_pages and decode_16bit and num_kv_splits != 1
                        and not _fills_gpu(num_tokens, max_seqs, block_q, num_kv_heads))
    if block_k is None:
        block_k = (64 if fp8_split_decode else 128) if decode_16bit else (
            64 if head_dim <= 128 else 32)
    num_tiles = pl.cdiv(max_pages * page_size, block_k)
    if num_kv_splits is None:
        num_kv_splits = _default_num_splits(num_tokens, max_seqs, block_q, num_kv_heads, num_tiles)
    unsplit_decode = decode_16bit and num_kv_splits == 1
    if block_q * group_pad < 16 or block_q & (block_q - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_q * {group_pad} (={block_q * group_pad}) and block_k={block_k} "
                         "must be powers of two >= 16")

    num_q_blocks = pl.cdiv(num_tokens, block_q) + max_seqs
    seq_starts = cu_q_lens[:-1] // block_q + jnp.arange(max_seqs, dtype=jnp.int32)
    loop_q_blocks = q_block_programs is not None and q_block_programs < num_q_blocks
    blocks_end = (_blocks_end(seq_starts, cu_q_lens, kv_lens, num_seqs, block_q, only),
                  ) if loop_q_blocks else ()
    seq_starts = jnp.pad(seq_starts, (0, _next_pow2(max_seqs) - max_seqs),
                         constant_values=jnp.iinfo(jnp.int32).max)  # [pow2 >= S]
    flat = (num_pages * num_kv_heads * page_size, head_dim)  # row (page * Hkv + head) * P + p
    split_shape = (num_kv_splits, num_tokens, num_q_heads)
    if num_kv_splits == 1:
        out_init = (jnp.full(q.shape, fill_value or 0.0, q.dtype) if out is None else out,)
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
                     jax.ShapeDtypeStruct(split_shape, jnp.float32)]
        out_init = () if fill_value is None else tuple(
            jnp.full(x.shape, fill_value, x.dtype) for x in out_shape)
    kernel = functools.partial(
        _attention_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        group=group, group_pad=group_pad, block_q=block_q, block_k=block_k, page_size=page_size,
        num_kv_heads=num_kv_heads,
        num_splits=num_kv_splits, num_sms=_num_sms(), k_scale=k_scale, v_scale=v_scale,
        only=only, loop_q_blocks=loop_q_blocks, interpret=interpret)
    v_flat = v_cache.reshape(flat)
    if v_pairs is None:
        v_pairs = decode_bucket and num_kv_splits == 1
    if v_pairs and fp8_pages and q.dtype.itemsize == 2:
        v_flat = jax.lax.bitcast_convert_type(v_flat.reshape(flat[0], head_dim // 2, 2),
                                              jnp.int16)
    inputs = (seq_starts, cu_q_lens, kv_lens, block_tables, num_seqs, q, k_cache.reshape(flat),
              v_flat, *blocks_end)
    outs = pl.pallas_call(
        kernel,
        grid=(q_block_programs if loop_q_blocks else num_q_blocks, num_kv_heads, num_kv_splits),
        out_shape=out_shape,
        input_output_aliases={len(inputs) + i: i for i in range(len(out_init))},
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps or (8 if unsplit_decode and not fp8_pages else 4),
            num_stages=num_stages or (3 if unsplit_decode else 2)),
        interpret=interpret,
        name="ragged_paged_attention",
    )(*inputs, *out_init)
    if num_kv_splits == 1:
        return outs[0]
    owned = _owned_tokens(cu_q_lens, kv_lens, num_seqs, num_tokens, only)
    rest = jnp.zeros((), q.dtype) if out is None else out
    return jnp.where(owned[:, None, None], _merge_splits(*outs).astype(q.dtype), rest)


def _seq_runs(cu_q_lens, kv_lens, num_seqs, only):
    """[S] bool: the live sequences with keys of the kind `only` names (None: all), those a
    launch for `only` runs (the kernel's own test, per sequence)."""
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    runs = (jnp.arange(q_lens.shape[0]) < num_seqs[0]) & (kv_lens > 0)
    if only is None:
        return runs
    return runs & ((q_lens == 1) == (only == "decode"))


def _blocks_end(seq_starts, cu_q_lens, kv_lens, num_seqs, block_q, only):
    """[1]: one past the last q block of the sequences a launch for `only` runs (0: none)."""
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    ends = seq_starts[:q_lens.shape[0]] + pl.cdiv(q_lens, block_q)
    return jnp.max(jnp.where(_seq_runs(cu_q_lens, kv_lens, num_seqs, only), ends, 0),
                   keepdims=True)


def _token_seqs(cu_q_lens, num_tokens):
    """Each flat token [T], its sequence [T] (padding tokens: the last), and q_lens [S]."""
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    seq = jnp.minimum(mgpu.count_at_most(cu_q_lens[1:], token), q_lens.shape[0] - 1)
    return token, seq, q_lens


def _owned_tokens(cu_q_lens, kv_lens, num_seqs, num_tokens, only):
    """[T] bool: the live tokens of the sequences a launch for `only` runs (_seq_runs)."""
    token, seq, _ = _token_seqs(cu_q_lens, num_tokens)
    return (token < cu_q_lens[num_seqs[0]]) & _seq_runs(cu_q_lens, kv_lens, num_seqs, only)[seq]
