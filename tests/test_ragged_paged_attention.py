"""Ragged paged attention: the Pallas kernel (interpret mode) against the pure-jnp reference,
and its lowering for CUDA on this CPU machine."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200

from pallas_kernels.ragged_paged_attention import (_triton_attention, ragged_paged_attention,
                                                   ragged_paged_attention_reference)


def make_batch(seed, q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, page_size,
               dtype=jnp.float32, max_seqs=None, num_tokens=None, max_pages=None):
    """Random inputs; every sequence's pages drawn from a random permutation of the cache."""
    rng = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    max_seqs = max_seqs or num_seqs
    pages_needed = [-(-n // page_size) for n in kv_lens]
    max_pages = max_pages or max(max(pages_needed), 1)
    num_pages = sum(pages_needed) + 3
    perm = rng.permutation(np.arange(1, num_pages))  # block 0 is the padding block
    block_tables = rng.integers(0, num_pages, (max_seqs, max_pages)).astype(np.int32)
    used = 0
    for s, n in enumerate(pages_needed):
        block_tables[s, :n] = perm[used:used + n]
        used += n
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1:] = cu[num_seqs]
    num_tokens = num_tokens or max(int(cu[-1]), 1)
    kv = np.zeros(max_seqs, np.int32)
    kv[:num_seqs] = kv_lens
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    cache_shape = (num_pages, num_kv_heads, page_size, head_dim)
    return (normal(num_tokens, num_q_heads, head_dim), normal(*cache_shape), normal(*cache_shape),
            jnp.asarray(kv), jnp.asarray(block_tables), jnp.asarray(cu),
            jnp.asarray([num_seqs], jnp.int32))


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def check(args, *, tol, public=False, ref_args=None, **kw):
    """Kernel vs the reference on fp32 inputs (`ref_args`, default the kernel's); live rows only.
    The Triton path runs on a NaN-filled output, so an element it leaves unwritten shows; with
    `public`, the public function (output filled with 0) instead."""
    kernel = (functools.partial(ragged_paged_attention, **kw) if public else
              functools.partial(_triton_attention, fill_value=float("nan"), **kw))
    out = jax.jit(functools.partial(kernel, interpret=True))(*args)
    ref_kw = {k: v for k, v in kw.items() if k in ("sm_scale", "sliding_window", "soft_cap")}
    upcast = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in ref_args or args]
    ref = ragged_paged_attention_reference(*upcast, **ref_kw)
    live = int(args[5][int(args[6][0])])
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert np.isfinite(np.asarray(out[:live], np.float32)).all(), "unwritten or NaN rows"
    assert rel_err(out[:live], ref[:live]) < tol
    return out


def poison(args):
    """(kernel args, reference args): every cache slot that no live sequence owns below its kv_len
    is NaN in the kernel's copy, and the block tables' unused entries name page 0 (all NaN), so a
    kernel that reads one K/V row it must not returns NaN; the reference reads the clean cache."""
    q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs = args
    num_pages, _, page_size, _ = k_cache.shape
    tables, owned = np.array(block_tables), np.zeros((num_pages, page_size), bool)  # [S, B], [N, P]
    tables[int(num_seqs[0]):] = 0
    for s, kv_len in enumerate(np.asarray(kv_lens)[:int(num_seqs[0])]):
        pages = -(-int(kv_len) // page_size)
        tables[s, pages:] = 0
        for j in range(pages):
            owned[tables[s, j], :min(page_size, kv_len - j * page_size)] = True
    assert not owned[0].any()  # make_batch leaves page 0 to padding
    nan = lambda c: jnp.where(jnp.asarray(owned)[:, None, :, None], c, jnp.nan).astype(c.dtype)
    tables = jnp.asarray(tables)
    return ((q, nan(k_cache), nan(v_cache), kv_lens, tables, cu_q_lens, num_seqs),
            (q, k_cache, v_cache, kv_lens, tables, cu_q_lens, num_seqs))


HEADS = [(9, 3, 64), (4, 1, 32), (8, 2, 128), (4, 2, 256)]  # group 3 (padded to 4), MQA, 4, 2


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", HEADS)
def test_mixed_prefill_decode_fp32(num_q_heads, num_kv_heads, head_dim):
    # q_len 0 (a finished sequence), 1 (decode), chunked prefill with and without context
    args = make_batch(1, [1, 0, 7, 1, 19], [40, 0, 7, 1, 50], num_q_heads=num_q_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16, max_seqs=7,
                      num_tokens=32)
    check(args, tol=1e-5, sm_scale=head_dim ** -0.5)


@pytest.mark.parametrize("page_size,block_k", [(16, 64), (32, 16), (64, 32)])
def test_page_sizes_decode_bf16(page_size, block_k):
    args = make_batch(2, [1] * 5, [1, 77, 130, 64, 200], num_q_heads=9, num_kv_heads=3,
                      head_dim=64, page_size=page_size, dtype=jnp.bfloat16, max_seqs=8,
                      num_tokens=8)
    check(args, tol=1e-2, sm_scale=0.125, block_k=block_k)


def test_long_context_split_kv():
    args = make_batch(3, [1, 1, 3], [1500, 700, 900], num_q_heads=8, num_kv_heads=2,
                      head_dim=64, page_size=16, max_seqs=4, num_tokens=8)
    for splits in (1, 5):
        check(args, tol=1e-5, sm_scale=0.125, num_kv_splits=splits)


def test_split_outputs_need_no_fill():
    """Without a fill value the KV splits' partial outputs are not initialised (no fill kernel
    a layer; interpret mode starts them as NaN): every split of every live row is written, and
    padding rows come back 0."""
    args = make_batch(3, [1, 1, 3], [1500, 700, 900], num_q_heads=8, num_kv_heads=2,
                      head_dim=64, page_size=16, max_seqs=4, num_tokens=8)
    kw = dict(sm_scale=0.125, num_kv_splits=5)
    jaxpr = jax.make_jaxpr(functools.partial(_triton_attention, interpret=True, **kw))(*args)
    [call] = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert not call.params["input_output_aliases"]
    out = check(args, tol=1e-5, public=True, **kw)
    assert not np.asarray(out[5:]).any()


def test_sliding_window_and_soft_cap():
    args = make_batch(4, [5, 1, 12], [60, 90, 12], num_q_heads=9, num_kv_heads=3, head_dim=64,
                      page_size=16, max_seqs=3, num_tokens=24)
    for splits in (1, 3):
        check(args, tol=1e-5, sm_scale=0.3, sliding_window=20, soft_cap=5.0, num_kv_splits=splits)


def test_default_tiles_prefill_bucket_and_padding_rows_zero():
    args = make_batch(5, [33, 2], [70, 2], num_q_heads=4, num_kv_heads=2, head_dim=32,
                      page_size=16, max_seqs=4, num_tokens=48)
    out = check(args, tol=1e-5, public=True, sm_scale=0.2)
    assert not np.asarray(out[35:]).any()


def test_random_ragged_batches():
    rng = np.random.default_rng(6)
    for seed in range(3):
        num_seqs = int(rng.integers(1, 6))
        q_lens = rng.integers(0, 9, num_seqs)
        kv_lens = q_lens + rng.integers(0, 120, num_seqs)
        args = make_batch(10 + seed, q_lens, kv_lens, num_q_heads=6, num_kv_heads=2, head_dim=32,
                          page_size=16, max_seqs=num_seqs + 1, num_tokens=int(q_lens.sum()) + 5)
        check(args, tol=1e-5, sm_scale=0.17, num_kv_splits=int(rng.integers(1, 4)))


def test_bad_shapes_raise():
    args = make_batch(7, [1], [5], num_q_heads=6, num_kv_heads=4, head_dim=32, page_size=16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ragged_paged_attention(*args, sm_scale=1.0, interpret=True)


# Context before each chunk: 64 and 96 put the first query on a tile boundary (of every / of the
# <= 32 tiles), 65 one past it, 31 one before; kv_lens 128 a multiple of every block_k, the rest
# not; q_lens 64 a multiple of every block_q, the rest not; the last sequence decodes.
BOUNDARY_CTX, BOUNDARY_Q = [64, 65, 0, 96, 31], [64, 13, 33, 7, 1]


@pytest.mark.parametrize("page_size,block_q,block_k,splits", [
    (16, 4, 16, 1), (16, 8, 64, 3), (64, 16, 32, 1), (32, 4, 32, 2)])
def test_prefill_tile_boundaries_poisoned(page_size, block_q, block_k, splits):
    # page 16 with block_k 64: per-token page ids; the others: one page id a tile
    args = make_batch(20, BOUNDARY_Q, np.add(BOUNDARY_CTX, BOUNDARY_Q), num_q_heads=6,
                      num_kv_heads=2, head_dim=32, page_size=page_size, max_seqs=6,
                      num_tokens=sum(BOUNDARY_Q) + 5)
    args, clean = poison(args)
    check(args, ref_args=clean, tol=1e-5, sm_scale=0.3, block_q=block_q, block_k=block_k,
          num_kv_splits=splits)


def test_prefill_long_context_ragged_bf16_poisoned():
    # default prefill tiles and split count; chunks over 700-1000 tokens of context, ragged
    q_lens, ctx = [50, 17, 3, 1], [700, 333, 1000, 900]
    args = make_batch(21, q_lens, np.add(ctx, q_lens), num_q_heads=8, num_kv_heads=2, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_seqs=5, num_tokens=80)
    args, clean = poison(args)
    check(args, ref_args=clean, tol=1e-2, sm_scale=0.125)


def test_poison_catches_reads_past_kv_len():
    # the poisoned cache is NaN exactly where no query may look: any read of it shows
    args, clean = poison(make_batch(22, [3], [40], num_q_heads=4, num_kv_heads=2, head_dim=32,
                                    page_size=16, max_pages=4))
    kv_lens = args[3] + 1
    out = ragged_paged_attention(*args[:3], kv_lens, *args[4:], sm_scale=0.3, interpret=True)
    assert np.isnan(np.asarray(out)).all()


def test_lowers_for_cuda():
    """Every code path lowers for CUDA: decode and prefill buckets, one and several KV splits,
    unmasked + masked loops (no window) and masked only (window), soft cap, fp32, head dim 256,
    one page id a tile (page 64) and per-token ids (page 16)."""
    sds = jax.ShapeDtypeStruct
    max_seqs, max_pages = 8, 16
    cases = [(64, (9, 3, 64), 16, jnp.bfloat16), (64, (32, 8, 128), 16, jnp.bfloat16),
             (8, (32, 8, 128), 64, jnp.bfloat16), (64, (8, 2, 64), 64, jnp.float32),
             (64, (8, 4, 256), 16, jnp.bfloat16)]
    for num_tokens, (num_q_heads, num_kv_heads, head_dim), page_size, dtype in cases:
        cache = sds((64, num_kv_heads, page_size, head_dim), dtype)
        args = (sds((num_tokens, num_q_heads, head_dim), dtype), cache, cache,
                sds((max_seqs,), jnp.int32), sds((max_seqs, max_pages), jnp.int32),
                sds((max_seqs + 1,), jnp.int32), sds((1,), jnp.int32))
        for splits in (1, 4):
            for extra in (dict(), dict(soft_cap=30.0, sliding_window=128)):
                fn = functools.partial(ragged_paged_attention, sm_scale=0.1,
                                       num_kv_splits=splits, **extra)
                assert "ragged_paged_attention" in lower_for_h200(fn, *args)


def test_sm_count_comes_from_the_device(monkeypatch):
    """The split-KV heuristic sizes for the GPU's own SM count; off a GPU, for a Hopper's."""
    import types

    from pallas_kernels import ragged_paged_attention as rpa
    assert rpa._num_sms() == rpa._HOPPER_NUM_SMS  # this CPU device has no core_count
    monkeypatch.setattr(rpa.jax, "devices", lambda: [types.SimpleNamespace(core_count=78)])
    assert rpa._num_sms() == 78
