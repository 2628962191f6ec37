"""KV write: the Pallas kernel (interpret mode) against the scatter reference, and its CUDA
lowering on this CPU machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200
from pallas_kernels.kv_write import write_kv, write_kv_pallas, write_kv_reference


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
def test_reference_writes_slots_and_keeps_the_rest(num_tokens):
    k_cache, v_cache, k, v, slots = random_step(1, num_tokens, num_tokens, dtype=jnp.float32)
    new_k, new_v = jax.jit(write_kv)(k_cache, v_cache, k, v, slots)
    # slot page * P + offset of head h is cache[page, h, offset]: slot-major rows [N * P, H, D]
    by_slot = lambda c: np.swapaxes(np.asarray(c), 1, 2).reshape(-1, 3, 64)
    flat = by_slot(new_k)
    np.testing.assert_array_equal(flat[np.asarray(slots)], np.asarray(k))
    untouched = np.setdiff1d(np.arange(flat.shape[0]), np.asarray(slots))
    np.testing.assert_array_equal(flat[untouched], by_slot(k_cache)[untouched])
    np.testing.assert_array_equal(by_slot(new_v)[np.asarray(slots)], np.asarray(v))


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
