"""Quantised kernels in interpret mode against their references, and their CUDA lowering on this
CPU machine: the int4 GEMM (zero point and scale applied per group), the FP8 weights' dot, and
the FP8 KV cache through the KV write and the Triton attention kernel."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200
from test_kv_write import random_step
from test_ragged_paged_attention import make_batch, poison, rel_err

from jaxllm.models.quant import GEMV_MAX_TOKENS, linear, quantize_fp8
from pallas_kernels import quant_matmul as qm
from pallas_kernels import ragged_paged_attention as rpa
from pallas_kernels.kv_write import write_kv_pallas, write_kv_reference
from pallas_kernels.ragged_paged_attention import (_triton_attention, ragged_paged_attention,
                                                   ragged_paged_attention_reference)

FP8 = jnp.float8_e4m3fn
# unit roundoff: half the spacing of x's dtype at 1 (a rounding to it errs by at most that,
# relatively)
UNIT = {jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11, jnp.float32: 2.0 ** -24}


def random_int4(seed, k, n, group):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n))
    scales = rng.uniform(0.005, 0.05, (k // group, n)).astype(np.float32)
    zeros = rng.integers(0, 16, (k // group, n)).astype(np.uint8)
    return q, scales, zeros


def test_pack_int4_round_trips_and_matches_its_definition():
    q, _, _ = random_int4(0, 256, 24, 32)
    packed = qm.pack_int4(q)
    np.testing.assert_array_equal(np.asarray(qm.unpack_int4(jnp.asarray(packed))), q)
    words = packed.view(np.uint32)  # word c*16 + r, nibble j = row c*128 + j*16 + r
    for c, r, j, n in [(0, 0, 0, 0), (1, 5, 7, 3), (0, 15, 3, 23), (1, 9, 2, 11)]:
        assert (words[c * 16 + r, n] >> (4 * j)) & 0xF == q[c * 128 + j * 16 + r, n]


@pytest.mark.parametrize("m,k,n,group,dtype,splits", [
    # groups shorter than a chunk, one chunk, longer (two chunks), all of K, and 48 (a group
    # that does not divide a chunk); M 1, 3, 17 and 70 (two M tiles), N ragged for block_n 32
    (1, 256, 96, 32, jnp.float32, None), (3, 384, 80, 64, jnp.bfloat16, None),
    (17, 256, 72, 128, jnp.bfloat16, None), (70, 384, 40, 384, jnp.float32, None),
    (5, 384, 64, 48, jnp.float16, None), (3, 512, 56, 256, jnp.bfloat16, None),
    # K split: even (2 x 2 chunks), uneven (3 + 2 chunks), one split per chunk, and splits
    # that cut a group (all of K in 4; two-chunk groups in 3 + 3 chunks)
    (1, 512, 96, 32, jnp.float32, 2), (3, 640, 64, 128, jnp.bfloat16, 2),
    (2, 384, 40, 64, jnp.float16, 3), (1, 512, 40, 512, jnp.bfloat16, 4),
    (17, 768, 56, 256, jnp.float32, 2)])
def test_int4_matmul_kernel_matches_reference(m, k, n, group, dtype, splits):
    """The kernel rounds once (its fp32 sums to x's dtype), the reference also each weight to
    x's dtype before the dot: their difference is bounded element by element by one rounding of
    each weight, one of each output, and the fp32 sums of both (K roundings of the terms
    summed; the kernel's terms, 16 s x (1 + q / 16) and 16 s (1 + z / 16) x, are under 32 s x)."""
    q, scales, zeros = random_int4(m, k, n, group)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, k)), dtype)
    args = (x, jnp.asarray(qm.pack_int4(q)), jnp.asarray(scales, dtype), jnp.asarray(zeros))
    got = qm.int4_matmul(*args, block_n=32, splits=splits, interpret=True)
    want = qm.int4_matmul_reference(*args)
    assert got.shape == (m, n) and got.dtype == dtype
    s = np.repeat(np.asarray(args[2], np.float64), group, 0)
    w = (q - np.repeat(zeros, group, 0)) * s
    x64 = np.abs(np.asarray(x, np.float64))
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    u = UNIT[dtype]
    bound = (u * (x64 @ np.abs(w)) + u * (np.abs(got64) + np.abs(want64))
             + k * 2.0 ** -24 * (x64 @ (np.abs(w) + 32 * s)))
    assert np.all(np.abs(got64 - want64) <= bound)
    # and against the exact product, in norm: about the output's one rounding
    assert rel_err(got, np.asarray(x, np.float64) @ w) < u + 1e-6


def test_int4_matmul_splits_k_only_where_tiles_are_few():
    # the 8B's projections at decode (M = 1, BN 64): o 64 tiles and down (K 14336) get 4
    # splits, qkv 96 tiles 2, gate/up 448 tiles none; a 2048-token prefill none
    assert qm.num_k_splits(1, 4096, 4096, 16, 64) == 4
    assert qm.num_k_splits(1, 14336, 4096, 16, 64) == 4
    assert qm.num_k_splits(1, 4096, 6144, 16, 64) == 2
    assert qm.num_k_splits(1, 4096, 28672, 16, 64) == 1
    assert qm.num_k_splits(2048, 4096, 4096, 64, 64) == 1
    assert qm.num_k_splits(1, 384, 4096, 16, 64) == 1  # each split >= 4 chunks


def test_int4_default_block_n_by_shape():
    # the 8B at decode: gate_up and down 256 columns, qkv and o 128 (256 would leave fewer
    # than _TARGET_PROGRAMS programs); more rows 64
    assert [qm.default_block_n(1, k, n) for k, n in
            ((4096, 28672), (14336, 4096), (4096, 6144), (4096, 4096))] == [256, 256, 128, 128]
    assert qm.default_block_n(2048, 4096, 28672) == 64


def test_int4_matmul_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    for m, groups, dtype, tiles in [(1, 32, jnp.bfloat16, {}), (256, 32, jnp.bfloat16, {}),
                                    (1, 128, jnp.bfloat16, dict(block_n=128, num_warps=8)),
                                    (16, 32, jnp.bfloat16, dict(block_n=256)),
                                    (16, 1, jnp.float16, {}), (3, 64, jnp.float32, {})]:
        args = (sds((m, 4096), dtype), sds((512, 6144), jnp.int32), sds((groups, 6144), dtype),
                sds((groups, 6144), jnp.uint8))
        assert "int4_matmul" in lower_for_h200(functools.partial(qm.int4_matmul, **tiles), *args)


def test_fp8_linear_lowers_to_an_fp8_dot():
    """The GEMM XLA's GPU compiler maps to cuBLASLt's FP8 kernels: float8_e4m3fn operands, the
    weight K-minor (Hopper's FP8 GEMMs take only that operand layout), the product in x's
    dtype (the scales applied after it). More tokens than the GEMV takes (tests/test_fp8_gemv.py
    lowers that path)."""
    tokens = GEMV_MAX_TOKENS + 1
    w = quantize_fp8(jnp.zeros((512, 768), jnp.bfloat16))
    text = lower_for_h200(lambda x, w: linear(x, w),
                          jax.ShapeDtypeStruct((tokens, 512), jnp.bfloat16),
                          jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w))
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert any("f8E4M3FN" in d and "contracting_dims = [1] x [1]" in d
               and f"-> tensor<{tokens}x768xbf16>" in d for d in dots), dots


# -- FP8 KV cache ---------------------------------------------------------------------------
def to_fp8(cache, scale):
    return (cache.astype(jnp.float32) / scale).astype(FP8)


def test_kv_write_fp8_pallas_matches_reference_and_scales():
    for num_tokens, num_live in [(40, 37), (5, 5)]:
        k_cache, v_cache, k, v, slots = random_step(num_tokens, num_tokens, num_live)
        k_cache, v_cache = k_cache.astype(FP8), v_cache.astype(FP8)
        k = k.at[0].set(1000.0)  # saturates to 448 * scale, never NaN
        got = write_kv_pallas(k_cache, v_cache, k, v, slots, k_scale=0.5, v_scale=2.0,
                              interpret=True)
        want = write_kv_reference(k_cache, v_cache, k, v, slots, k_scale=0.5, v_scale=2.0)
        for g, w in zip(got, want):
            assert g.dtype == FP8
            np.testing.assert_array_equal(np.asarray(g, np.float32)[1:],
                                          np.asarray(w, np.float32)[1:])  # block 0: padding
        by_slot = np.swapaxes(np.asarray(want[0], np.float32), 1, 2).reshape(-1, 3, 64)
        written = by_slot[np.asarray(slots)[:num_live]]
        expect = np.clip(np.asarray(k, np.float32)[:num_live] / 0.5, -448, 448)
        np.testing.assert_allclose(written, expect, rtol=2 ** -4, atol=2 ** -9)  # e4m3: 3 bits


def check_fp8(args, *, k_scale, v_scale, tol, ref_args=None, **kw):
    """Kernel on fp8 pages (bf16 q) vs the reference on the same pages (fp32 q)."""
    kernel = functools.partial(_triton_attention, fill_value=float("nan"), k_scale=k_scale,
                               v_scale=v_scale, interpret=True, **kw)
    out = jax.jit(kernel)(*args)
    ref_in = list(ref_args or args)
    ref_in[0] = ref_in[0].astype(jnp.float32)
    ref = ragged_paged_attention_reference(*ref_in, sm_scale=kw["sm_scale"], k_scale=k_scale,
                                           v_scale=v_scale, soft_cap=kw.get("soft_cap"))
    live = int(args[5][int(args[6][0])])
    assert np.isfinite(np.asarray(out[:live], np.float32)).all()
    assert rel_err(out[:live], ref[:live]) < tol
    return ref


# (q_lens, num_tokens): a prefill bucket, and a decode bucket (no more tokens than sequences),
# which takes the float8 pages' own tiles
FP8_BUCKETS = {"prefill": ([7, 1, 0, 13, 1], 32), "decode": ([1, 1, 0, 1, 1], 6)}


@pytest.mark.parametrize("bucket,splits,soft_cap,v_pairs", [
    ("prefill", 1, None, None), ("prefill", 3, None, None), ("prefill", 1, None, True),
    ("decode", 1, None, None), ("decode", 3, None, None), ("decode", 1, 30.0, None),
    ("decode", 1, None, False), ("decode", 3, None, True)])
def test_triton_attention_reads_fp8_pages_poisoned(bucket, splits, soft_cap, v_pairs):
    """q runs scaled in float16 against the float8 pages, the soft cap's scale included; V read
    as float8 or as int16 pairs (each bucket's default, and the other)."""
    q_lens, num_tokens = FP8_BUCKETS[bucket]
    ctx = [40, 300, 0, 3, 200]
    args = make_batch(30 + splits, q_lens, np.add(ctx, q_lens), num_q_heads=8, num_kv_heads=2,
                      head_dim=64, page_size=16, max_seqs=6, num_tokens=num_tokens)
    q, k_cache, v_cache, *rest = args
    fp8_args = (q.astype(jnp.bfloat16), to_fp8(k_cache, 0.25), to_fp8(v_cache, 4.0), *rest)
    poisoned, clean = poison(fp8_args)
    ref = check_fp8(poisoned, ref_args=clean, k_scale=0.25, v_scale=4.0, tol=2e-2, sm_scale=0.125,
                    num_kv_splits=splits, soft_cap=soft_cap, v_pairs=v_pairs)
    # and the FP8 pages are close to the 16-bit attention they stand for
    exact = ragged_paged_attention_reference(*args, sm_scale=0.125, soft_cap=soft_cap)
    live = int(args[5][len(q_lens)])
    assert rel_err(ref[:live], exact[:live]) < 0.1


def test_reference_reads_fp8_pages_unwidened_and_as_their_values():
    """XLA's CPU backend widens a float8 array a loop reads, the whole cache a call: there the
    reference's loop reads the pages' bits and widens only those it gathers, to the values the
    same pages hold as float32. For a GPU it is lowered as it is."""
    args = make_batch(41, [7, 1, 0, 13, 1], np.add([40, 300, 0, 3, 200], [7, 1, 0, 13, 1]),
                      num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_seqs=6,
                      num_tokens=32)
    q, k_cache, v_cache, *rest = args
    fp8_args = (q, to_fp8(k_cache, 0.25), to_fp8(v_cache, 4.0), *rest)
    reference = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.125,
                                          k_scale=0.25, v_scale=4.0))
    got = reference(*fp8_args)
    want = reference(q, *(c.astype(jnp.float32) for c in fp8_args[1:3]), *rest)
    live = int(args[5][5])
    np.testing.assert_allclose(np.asarray(got[:live]), np.asarray(want[:live]), rtol=1e-6,
                               atol=1e-6)
    shape = ",".join(map(str, k_cache.shape))
    hlo = reference.lower(*fp8_args).compile().as_text()
    assert not re.search(rf"\b(f16|bf16|f32)\[{shape}\]", hlo)
    cuda = lower_for_h200(reference, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in fp8_args))
    assert "bitcast_convert" not in cuda


def mixed_fp8_batch(seed):
    """A prefill bucket on float8 pages: decodes (q_len 1) among prefill chunks, poisoned."""
    q_lens = [1, 7, 1, 0, 13, 1]
    args = make_batch(seed, q_lens, np.add([300, 40, 3, 0, 200, 90], q_lens), num_q_heads=8,
                      num_kv_heads=2, head_dim=64, page_size=16, max_seqs=7, num_tokens=32)
    q, k_cache, v_cache, *rest = args
    fp8_args = (q.astype(jnp.bfloat16), to_fp8(k_cache, 0.25), to_fp8(v_cache, 4.0), *rest)
    poisoned, clean = poison(fp8_args)
    is_decode = np.repeat(np.equal(q_lens, 1), q_lens)
    return poisoned, clean, is_decode


@pytest.mark.parametrize("only,splits,programs", [
    ("decode", 1, None), ("decode", 3, None), ("prefill", 1, None), ("prefill", 3, None),
    ("prefill", 1, 2), ("prefill", 3, 1), ("decode", 1, 3)])
def test_triton_attention_only_one_kind_writes_its_rows(only, splits, programs):
    """A launch for one kind of sequence writes its rows (right) and leaves the others as they
    came in (`out`), the merge of KV splits included; also with fewer programs than q blocks,
    each looping over its share."""
    poisoned, clean, is_decode = mixed_fp8_batch(50 + splits)
    kw = dict(sm_scale=0.125, k_scale=0.25, v_scale=4.0, interpret=True, num_kv_splits=splits,
              q_block_programs=programs)
    live = len(is_decode)
    before = jnp.full(poisoned[0].shape, 7.0, jnp.bfloat16)
    out = jax.jit(functools.partial(_triton_attention, only=only, fill_value=float("nan"),
                                    **kw))(*poisoned, out=before)
    ref_in = [clean[0].astype(jnp.float32), *clean[1:]]
    ref = ragged_paged_attention_reference(*ref_in, sm_scale=0.125, k_scale=0.25, v_scale=4.0)
    mine = is_decode if only == "decode" else ~is_decode
    out = np.asarray(out, np.float32)
    assert rel_err(out[:live][mine], ref[:live][mine]) < 2e-2
    np.testing.assert_array_equal(out[:live][~mine], 7.0)
    if splits == 1:  # the aliased output: padding rows untouched too
        np.testing.assert_array_equal(out[live:], 7.0)


def test_fp8_prefill_bucket_runs_its_decodes_apart():
    """The entry on float8 pages in a prefill bucket: two launches (decodes at the decode
    tiling), every live row right."""
    poisoned, clean, is_decode = mixed_fp8_batch(60)
    fn = functools.partial(ragged_paged_attention, sm_scale=0.125, k_scale=0.25, v_scale=4.0,
                           interpret=True)
    assert str(jax.make_jaxpr(fn)(*poisoned)).count("pallas_call") == 2
    out = np.asarray(fn(*poisoned), np.float32)
    ref = ragged_paged_attention_reference(clean[0].astype(jnp.float32), *clean[1:],
                                           sm_scale=0.125, k_scale=0.25, v_scale=4.0)
    live = len(is_decode)
    assert np.isfinite(out).all()
    assert rel_err(out[:live], ref[:live]) < 2e-2


@pytest.mark.parametrize("num_staged,max_seqs,staged_seqs", [
    (16, 16, [1]), (64, 1, [1]), (64, 16, [1, 4]), (2, 16, [])])
def test_fp8_prefill_pages_staged_in_16_bits(num_staged, max_seqs, staged_seqs):
    """The prefill sequences' pages copied for the Mosaic kernel, in batch order while they fit
    the pages and the sequences given: attention over the copies (k_scale folded into sm_scale)
    is the float8 cache's; the decodes and the sequences not staged keep their kv_lens for the
    Triton kernel. Prefill sequences: 1 (47 keys: 3 pages) and 4 (213 keys: 14 pages)."""
    _, clean, _ = mixed_fp8_batch(70)
    q, k_cache, v_cache, kv_lens, tables, cu, num_seqs = clean
    k16, v16, staged_tables, staged_kv, rest_kv = rpa._stage_prefill_pages(
        k_cache, v_cache, kv_lens, tables, cu, num_seqs, dtype=jnp.bfloat16, v_scale=4.0,
        num_staged=num_staged, max_staged_seqs=max_seqs)
    assert k16.shape == (num_staged, *k_cache.shape[1:]) and k16.dtype == jnp.bfloat16
    staged = np.isin(np.arange(7), staged_seqs)
    np.testing.assert_array_equal(staged_kv, np.where(staged, kv_lens, 0))
    np.testing.assert_array_equal(rest_kv, np.where(staged, 0, kv_lens))
    ref_in = [clean[0].astype(jnp.float32), *clean[1:]]
    want = ragged_paged_attention_reference(*ref_in, sm_scale=0.125, k_scale=0.25, v_scale=4.0)
    got = ragged_paged_attention_reference(
        q.astype(jnp.float32), k16.astype(jnp.float32), v16.astype(jnp.float32), staged_kv,
        staged_tables, cu, num_seqs, sm_scale=0.125 * 0.25)
    for s in staged_seqs:
        rows = slice(int(cu[s]), int(cu[s + 1]))
        assert np.isfinite(np.asarray(got[rows])).all()
        assert rel_err(got[rows], want[rows]) < 1e-2  # V times its scale, rounded to bf16


def test_fp8_mosaic_path_writes_every_row_from_its_kernel(monkeypatch):
    """implementation='mosaic' on float8 pages: the staged prefill on the Mosaic kernel (here a
    stand-in that leaves the rows of sequences without keys NaN, as the kernel leaves them
    unwritten), the prefill past the staged pages and the decodes on the Triton kernel."""
    def mosaic_stand_in(q, k, v, kv_lens, tables, cu, num_seqs, *, sm_scale, max_keyed_seqs):
        assert max_keyed_seqs == 7  # the batch's 7 slots, under the 16 staged at most
        # the kernel masks a last page's rows past kv_len (poisoned here), the reference's
        # products with them would be NaN
        k, v = (jnp.nan_to_num(x.astype(jnp.float32)) for x in (k, v))
        out = ragged_paged_attention_reference(q.astype(jnp.float32), k, v, kv_lens, tables, cu,
                                               num_seqs, sm_scale=sm_scale)
        token = jnp.arange(q.shape[0])
        seq = jnp.searchsorted(cu[1:], token, side="right")
        keyless = (token < cu[num_seqs[0]]) & (kv_lens[jnp.minimum(seq, kv_lens.shape[0] - 1)] == 0)
        live = token < cu[num_seqs[0]]
        out = jnp.where(keyless[:, None, None], jnp.nan, jnp.where(live[:, None, None], out, 0))
        return out.astype(q.dtype)

    monkeypatch.setattr(rpa.mgpu, "ragged_paged_attention_mgpu", mosaic_stand_in)
    poisoned, clean, is_decode = mixed_fp8_batch(80)
    kw = dict(sm_scale=0.125, k_scale=0.25, v_scale=4.0, interpret=True)
    out = jax.jit(lambda *a: rpa._staged_mosaic(*a, **kw))(*poisoned)
    ref = ragged_paged_attention_reference(clean[0].astype(jnp.float32), *clean[1:],
                                           sm_scale=0.125, k_scale=0.25, v_scale=4.0)
    live = len(is_decode)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    assert rel_err(out[:live], ref[:live]) < 2e-2
    np.testing.assert_array_equal(out[live:], 0.0)


def test_fp8_cache_takes_mosaic_only_where_supported():
    args = make_batch(40, [9, 4], [20, 4], num_q_heads=4, num_kv_heads=2, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_seqs=2, num_tokens=16)
    q, k_cache, v_cache, *rest = args
    fp8_args = (q, k_cache.astype(FP8), v_cache.astype(FP8), *rest)
    with pytest.raises(ValueError, match="no sliding window"):
        ragged_paged_attention(*fp8_args, sm_scale=0.1, sliding_window=8,
                               implementation="mosaic")
    with pytest.raises(ValueError, match="16-bit q"):
        ragged_paged_attention(fp8_args[0].astype(jnp.float32), *fp8_args[1:], sm_scale=0.1,
                               implementation="mosaic")


def test_fp8_cache_lowers_for_cuda(monkeypatch):
    sds = jax.ShapeDtypeStruct
    cache = sds((64, 8, 16, 128), FP8)
    for num_tokens, splits in ((8, 4), (8, 1), (64, 1)):  # decode: V as float8, as pairs
        args = (sds((num_tokens, 32, 128), jnp.bfloat16), cache, cache, sds((8,), jnp.int32),
                sds((8, 16), jnp.int32), sds((9,), jnp.int32), sds((1,), jnp.int32))
        fn = functools.partial(ragged_paged_attention, sm_scale=0.1, num_kv_splits=splits,
                               k_scale=0.5, v_scale=2.0)
        assert "ragged_paged_attention" in lower_for_h200(fn, *args)
    prefill = (sds((64, 32, 128), jnp.bfloat16), cache, cache, sds((8,), jnp.int32),
               sds((8, 16), jnp.int32), sds((9,), jnp.int32), sds((1,), jnp.int32))
    both = lower_for_h200(functools.partial(ragged_paged_attention, sm_scale=0.1, k_scale=0.5,
                                            v_scale=2.0), *prefill)
    # off Hopper: the prefill on Triton too, the decodes apart
    assert "mosaic_gpu" not in both and both.count("ragged_paged_attention") >= 2
    monkeypatch.setattr(rpa, "_is_hopper", lambda: True)
    for implementation in ("mosaic", None):  # on Hopper the staged prefill is the default
        staged = lower_for_h200(functools.partial(ragged_paged_attention, sm_scale=0.1,
                                                  k_scale=0.5, v_scale=2.0,
                                                  implementation=implementation), *prefill)
        assert "mosaic_gpu" in staged and staged.count("ragged_paged_attention") >= 2
    triton = lower_for_h200(functools.partial(ragged_paged_attention, sm_scale=0.1, k_scale=0.5,
                                              v_scale=2.0, implementation="triton"), *prefill)
    assert "mosaic_gpu" not in triton
    kv = sds((100, 8, 128), jnp.bfloat16)
    write = jax.jit(functools.partial(write_kv_pallas, k_scale=0.5), donate_argnums=(0, 1))
    assert "write_kv" in lower_for_h200(write, cache, cache, kv, kv, sds((100,), jnp.int32))


def test_a_float8_cache_the_triton_kernel_cannot_address_is_refused():
    """Pallas offsets arrays of 2 to 4 GiB with signed 32-bit integers: such a float8 cache
    would be read at wrapped addresses (H200: garbage at 2.4 GB), so it is refused by name."""
    sds = jax.ShapeDtypeStruct
    args = lambda pages: (sds((8, 32, 128), jnp.bfloat16), sds((pages, 8, 16, 128), FP8),
                          sds((pages, 8, 16, 128), FP8), sds((8,), jnp.int32),
                          sds((8, 16), jnp.int32), sds((9,), jnp.int32), sds((1,), jnp.int32))
    fn = functools.partial(ragged_paged_attention, sm_scale=0.1, k_scale=0.5, v_scale=2.0)
    jax.eval_shape(fn, *args(2**17))  # 2 GiB: addressable
    with pytest.raises(ValueError, match="not addressable"):
        jax.eval_shape(fn, *args(2**17 + 1))


def test_fp8_decode_tiling_defaults():
    """The measured tilings (docs/lab/2026-12-05-session29.md): float8 pages without KV splits
    (512 decodes) at 4 warps and 3 stages, bf16 pages at 8 and 3; with splits (8 decodes of up
    to 2,048 tokens) 64-token tiles, so 2,048 / 64 / 4 = 8 splits where 128-token tiles give 4."""
    sds = jax.ShapeDtypeStruct

    def tiling(num_seqs, dtype):
        cache = sds((4096, 8, 16, 128), dtype)
        args = (sds((num_seqs, 32, 128), jnp.bfloat16), cache, cache, sds((num_seqs,), jnp.int32),
                sds((num_seqs, 128), jnp.int32), sds((num_seqs + 1,), jnp.int32),
                sds((1,), jnp.int32))
        jaxpr = jax.make_jaxpr(functools.partial(_triton_attention, sm_scale=0.1))(*args)
        [call] = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
        params = call.params["compiler_params"]
        return params.num_warps, params.num_stages, call.params["grid_mapping"].grid[2]

    assert tiling(512, FP8) == (4, 3, 1)
    assert tiling(512, jnp.bfloat16) == (8, 3, 1)
    assert tiling(8, FP8) == (4, 2, 8)
    assert tiling(8, jnp.bfloat16) == (4, 2, 4)
