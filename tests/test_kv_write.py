"""KV write: the Pallas kernels (interpret mode; the plain write and the rope and write) against
their references, and their CUDA lowering on this CPU machine."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200
from pallas_kernels.fp8_gemv import Splits, finish_splits
from pallas_kernels.kv_write import (rope_reference, rope_write_kv, rope_write_kv_reference,
                                     write_kv, write_kv_pallas, write_kv_reference)


def random_step(seed, num_tokens, num_live, num_pages=12, page_size=16, num_kv_heads=3,
                head_dim=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    shape = (num_pages, num_kv_heads, page_size, head_dim)  # head-major pages
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(dtype)
    slots = np.zeros(num_tokens, np.int32)  # padding tokens write to the padding block 0
    slots[:num_live] = rng.permutation(np.arange(page_size, num_pages * page_size))[:num_live]
    return (normal(*shape), normal(*shape), normal(num_tokens, num_kv_heads, head_dim),
            normal(num_tokens, num_kv_heads, head_dim), jnp.asarray(slots))


def test_pallas_matches_reference():
    for num_tokens, num_live in [(40, 37), (5, 5), (16, 1)]:
        k_cache, v_cache, k, v, slots = random_step(num_tokens, num_tokens, num_live)
        got = write_kv_pallas(k_cache, v_cache, k, v, slots, interpret=True)
        want = write_kv_reference(k_cache, v_cache, k, v, slots)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32)[1:],
                                          np.asarray(w, np.float32)[1:])  # block 0: padding


@pytest.mark.parametrize("num_tokens", [8, 1])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_reference_writes_slots_and_keeps_the_rest(num_tokens, dtype):
    k_cache, v_cache, k, v, slots = random_step(1, num_tokens, num_tokens, dtype=dtype)
    new_k, new_v = jax.jit(write_kv)(k_cache, v_cache, k, v, slots)
    # slot page * P + offset of head h is cache[page, h, offset]: slot-major rows [N * P, H, D]
    by_slot = lambda c: np.swapaxes(np.asarray(c, np.float32), 1, 2).reshape(-1, 3, 64)
    flat = by_slot(new_k)
    np.testing.assert_array_equal(flat[np.asarray(slots)], np.asarray(k, np.float32))
    untouched = np.setdiff1d(np.arange(flat.shape[0]), np.asarray(slots))
    np.testing.assert_array_equal(flat[untouched], by_slot(k_cache)[untouched])
    np.testing.assert_array_equal(by_slot(new_v)[np.asarray(slots)], np.asarray(v, np.float32))


@pytest.mark.parametrize("num_tokens", [8, 1])
def test_fp8_cache_is_not_widened_to_be_written(num_tokens):
    """XLA's CPU backend widens a whole float8 array to scatter into it or update a slice of it
    (a copy of the cache a layer and step): there the write updates the cache's bits instead.
    For a GPU the write is lowered as it is, with no bitcasts around it."""
    k_cache, v_cache, k, v, slots = random_step(3, num_tokens, num_tokens, num_pages=64,
                                                dtype=jnp.float8_e4m3fn)
    hlo = jax.jit(write_kv).lower(k_cache, v_cache, k, v, slots).compile().as_text()
    assert not re.search(r"\b(f16|bf16|f32)\[64,3,16,64\]", hlo)
    cuda = lower_for_h200(write_kv, *(jax.ShapeDtypeStruct(x.shape, x.dtype)
                                      for x in (k_cache, v_cache, k, v, slots)))
    assert "bitcast_convert" not in cuda
    assert ("dynamic_update_slice" if num_tokens == 1 else "scatter") in cuda


def test_one_token_writes_by_dynamic_update_slice():
    """A one-row scatter costs XLA a select kernel more per cache than the slice update."""
    k_cache, v_cache, k, v, slots = random_step(2, 1, 1)
    hlo = jax.jit(write_kv).lower(k_cache, v_cache, k, v, slots).as_text()
    assert "dynamic_update_slice" in hlo and "scatter" not in hlo


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    cache = sds((64, 8, 16, 128), jnp.bfloat16)
    args = (cache, cache, sds((100, 8, 128), jnp.bfloat16), sds((100, 8, 128), jnp.bfloat16),
            sds((100,), jnp.int32))
    assert "write_kv" in lower_for_h200(jax.jit(write_kv_pallas, donate_argnums=(0, 1)), *args)


def random_rope_step(seed, num_tokens, num_live, group=3, cache_dtype=jnp.bfloat16, **kw):
    """random_step's caches and slots, a fused qkv [T, Hkv, G + 2, D] and a rope's angles."""
    k_cache, v_cache, _, _, slots = random_step(seed, num_tokens, num_live, **kw)
    _, num_kv_heads, _, head_dim = k_cache.shape
    rng = np.random.default_rng(seed + 1)
    qkv = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, group + 2, head_dim)),
                      jnp.float32).astype(k_cache.dtype)
    angles = (rng.integers(0, 4000, num_tokens)[:, None, None]
              * 10000.0 ** (-np.arange(head_dim // 2) / (head_dim // 2)))
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    return k_cache.astype(cache_dtype), v_cache.astype(cache_dtype), qkv, cos, sin, slots


def assert_rope_write_close(got, want):
    """(q, k_cache, v_cache) within one bf16 rounding (the caches past block 0, padding's)."""
    for g, w in zip(got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if g.ndim == 4:
            g, w = g[1:], w[1:]
        np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=2 ** -7)


def test_rope_reference_is_hf_rotate_half():
    _, _, qkv, cos, sin, _ = random_rope_step(3, 5, 5, dtype=jnp.float32)
    x = np.asarray(qkv[:, :, 0], np.float64)  # [T, H, D]
    c, s = (np.concatenate([np.asarray(a, np.float64)] * 2, -1) for a in (cos, sin))
    rotate_half = np.concatenate([-x[..., 32:], x[..., :32]], -1)
    np.testing.assert_allclose(np.asarray(rope_reference(qkv[:, :, 0], cos, sin)),
                               x * c + rotate_half * s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens,num_live,group", [(40, 37, 3), (1, 1, 4), (16, 9, 1)])
def test_rope_write_matches_reference(num_tokens, num_live, group):
    """Ragged token counts (a partial last block, padding tokens), permuted slots, caches of
    random values (a slot not written keeps its value)."""
    args = random_rope_step(num_tokens, num_tokens, num_live, group)
    q, k_cache, v_cache = rope_write_kv(*args, interpret=True)
    want_q, want_k, want_v = rope_write_kv_reference(*args)
    assert q.shape == (num_tokens, 3 * group, 64) and q.dtype == jnp.bfloat16
    # one bf16 rounding of the same fp32 sums (a fused multiply-add may round the sum apart)
    np.testing.assert_allclose(np.asarray(q, np.float32), np.asarray(want_q, np.float32),
                               rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(np.asarray(k_cache, np.float32)[1:],
                               np.asarray(want_k, np.float32)[1:], rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_array_equal(np.asarray(v_cache, np.float32)[1:],
                                  np.asarray(want_v, np.float32)[1:])  # block 0: padding
    # and the reference is the unfused path: the GEMM's q heads roped, then the KV write
    k = rope_reference(args[2][:, :, group], args[3], args[4])
    unfused = write_kv_reference(args[0], args[1], k, args[2][:, :, group + 1], args[5])
    np.testing.assert_array_equal(np.asarray(want_k, np.float32),
                                  np.asarray(unfused[0], np.float32))


def test_rope_write_fp8_cache_scales_and_saturates():
    k_cache, v_cache, qkv, cos, sin, slots = random_rope_step(
        7, 24, 20, cache_dtype=jnp.float8_e4m3fn)
    qkv = qkv * 300.0  # past float8's 448 after the scales: saturated, not NaN
    got = rope_write_kv(k_cache, v_cache, qkv, cos, sin, slots, k_scale=0.5, v_scale=2.0,
                        interpret=True)
    want = rope_write_kv_reference(k_cache, v_cache, qkv, cos, sin, slots, k_scale=0.5,
                                   v_scale=2.0)
    for g, w in zip(got[1:], want[1:]):
        g, w = np.asarray(g, np.float32)[1:], np.asarray(w, np.float32)[1:]
        assert np.isfinite(g).all() and np.abs(g).max() == 448
        np.testing.assert_allclose(g, w, rtol=2 ** -3)  # float8's step, at most one apart


@pytest.mark.parametrize("stacked", [False, True])
def test_rope_write_scales_an_fp8_product_first(stacked):
    """qkv as an FP8 GEMM's unscaled product (fp32 here): per-token and per-channel scales
    applied and rounded to the projection's dtype before the rope, as ScaledProduct.value();
    the channel scales may come as one layer's row of a stack."""
    k_cache, v_cache, qkv, cos, sin, slots = random_rope_step(5, 21, 19, dtype=jnp.float32)
    rng = np.random.default_rng(9)
    row = jnp.asarray(rng.uniform(0.01, 2.0, 21), jnp.float32)
    col = jnp.asarray(rng.uniform(0.01, 2.0, qkv.shape[1:]), jnp.float32)
    caches = tuple(c.astype(jnp.bfloat16) for c in (k_cache, v_cache))
    stack, layer = (jnp.stack([col * 3.0, col, col * 5.0]), 1) if stacked else (col, None)
    got = rope_write_kv(*caches, qkv, cos, sin, slots, product_scales=(row, stack),
                        dtype=jnp.bfloat16, layer=layer, interpret=True)
    scaled = (qkv * row[:, None, None, None] * col).astype(jnp.bfloat16)
    want = rope_write_kv_reference(*caches, scaled, cos, sin, slots)
    assert got[0].dtype == jnp.bfloat16
    assert_rope_write_close(got, want)
    unscaled = rope_write_kv(*caches, qkv, cos, sin, slots, interpret=True)
    assert not np.allclose(np.asarray(unscaled[0], np.float32), np.asarray(got[0], np.float32),
                           atol=0.1)


@pytest.mark.parametrize("norm", [False, True])
def test_rope_write_finishes_a_k_split_gemv(norm):
    """qkv as a K-split GEMV's fp32 partial products (and, with its input norm, the partial
    sums of x^2): summed in split order and times the RMS, to the projection's dtype, before
    the rope, as the GEMV's own end (fp8_gemv.finish_splits)."""
    k_cache, v_cache, qkv, cos, sin, slots = random_rope_step(11, 19, 17)
    rng = np.random.default_rng(4)
    parts = jnp.asarray(rng.standard_normal((3, *qkv.shape)), jnp.float32)
    sumsq = jnp.asarray(rng.uniform(1.0, 50.0, (3, 19)), jnp.float32) if norm else None
    got = rope_write_kv(k_cache, v_cache, parts, cos, sin, slots, splits=(sumsq, 64, 1e-5),
                        dtype=jnp.bfloat16, interpret=True)
    finished = finish_splits(Splits(parts.reshape(3, 19, -1), sumsq), 64, 1e-5, jnp.bfloat16)
    want = rope_write_kv_reference(k_cache, v_cache, finished.reshape(qkv.shape), cos, sin, slots)
    ref = rope_write_kv_reference(k_cache, v_cache, parts, cos, sin, slots,
                                  splits=(sumsq, 64, 1e-5), dtype=jnp.bfloat16)
    assert_rope_write_close(got, want)
    for r, w in zip(ref, want):
        np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(w, np.float32))
    one_split = rope_write_kv(k_cache, v_cache, parts[:1], cos, sin, slots,
                              splits=(None if sumsq is None else sumsq[:1], 64, 1e-5),
                              dtype=jnp.bfloat16, interpret=True)
    assert not np.allclose(np.asarray(one_split[0], np.float32), np.asarray(got[0], np.float32),
                           atol=0.1)


def test_rope_write_refuses_mismatched_shapes():
    k_cache, v_cache, qkv, cos, sin, slots = random_rope_step(1, 4, 4)
    with pytest.raises(ValueError, match="G \\+ 2"):
        rope_write_kv(k_cache, v_cache, qkv[:, :2], cos, sin, slots, interpret=True)
    with pytest.raises(ValueError, match="cos"):
        rope_write_kv(k_cache, v_cache, qkv, cos[:, :, :8], sin[:, :, :8], slots, interpret=True)
    stack = jnp.ones((2, *qkv.shape[1:]), jnp.float32)
    with pytest.raises(ValueError, match="stacked"):  # a stack without its row
        rope_write_kv(k_cache, v_cache, qkv, cos, sin, slots, interpret=True,
                      product_scales=(jnp.ones(4, jnp.float32), stack))
    with pytest.raises(ValueError, match="needs dtype"):  # an fp32 product, q's dtype unsaid
        rope_write_kv(k_cache, v_cache, qkv[None].astype(jnp.float32), cos, sin, slots,
                      splits=(None, 64, 1e-5), interpret=True)


@pytest.mark.parametrize("num_tokens,scaled,dtype,head_dim", [
    (1, False, jnp.bfloat16, 128), (2048, False, jnp.bfloat16, 128), (512, True, jnp.bfloat16, 128),
    (1, "splits", jnp.bfloat16, 128),
    (7, False, jnp.float32, 64), (33, False, jnp.float16, 64)])  # the start-up matrix's dtypes
def test_rope_write_lowers_for_cuda(num_tokens, scaled, dtype, head_dim):
    sds = jax.ShapeDtypeStruct
    cache = sds((64, 8, 16, head_dim), jnp.float8_e4m3fn if scaled else dtype)
    angles = sds((num_tokens, 1, head_dim // 2), jnp.float32)
    args = (cache, cache, sds((num_tokens, 8, 6, head_dim), dtype), angles, angles,
            sds((num_tokens,), jnp.int32))
    fn = rope_write_kv
    if scaled == "splits":  # a one-token GEMV's two K splits, its input norm's sums inside
        args = (*args[:2], sds((2, num_tokens, 8, 6, head_dim), jnp.float32), *args[3:],
                sds((2, num_tokens), jnp.float32))

        def fn(*args):
            return rope_write_kv(*args[:6], splits=(args[6], 4096, 1e-5), dtype=jnp.bfloat16)
    elif scaled:  # an FP8 GEMM's product, its channel scales one layer's row of a stack
        args += (sds((num_tokens,), jnp.float32), sds((32, 8, 6, 128), jnp.float32))

        def fn(*args):
            return rope_write_kv(*args[:6], product_scales=args[6:], dtype=jnp.bfloat16,
                                 layer=3)
    assert "rope_write_kv" in lower_for_h200(jax.jit(fn, donate_argnums=(0, 1)), *args)
