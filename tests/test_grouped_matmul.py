"""Grouped matmul and the fused gate/up pass (MoE experts): the Pallas kernels in interpret mode
against the pure-jnp references and jax.lax.ragged_dot, on random group sizes (empty groups,
one-row groups, rows past the last group), poisoned inputs past the groups; and their CUDA
lowering on this CPU machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200
from pallas_kernels.grouped_matmul import (grouped_matmul, grouped_matmul_reference,
                                           grouped_swiglu, grouped_swiglu_reference)


def random_problem(seed, num_rows, num_groups, k_dim, n_dim, num_used, dtype):
    """num_used of num_rows rows belong to groups (random sizes, some 0); the rest is NaN."""
    rng = np.random.default_rng(seed)
    group_of_row = np.sort(rng.integers(0, num_groups, size=num_used))
    sizes = np.bincount(group_of_row, minlength=num_groups).astype(np.int32)
    x = rng.standard_normal((num_rows, k_dim)).astype(np.float32)
    x[num_used:] = np.nan  # rows past the groups must not leak into the output
    w = rng.standard_normal((num_groups, k_dim, n_dim)).astype(np.float32) / np.sqrt(k_dim)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes)


CASES = [  # num_rows, num_groups, K, N, rows in groups
    (64, 8, 64, 128, 64),
    (40, 16, 96, 80, 33),  # K, N not multiples of the blocks; more groups than rows per tile
    (512, 128, 128, 192, 512),  # decode-like: ~4 rows an expert
    (300, 5, 64, 64, 170),
    (16, 4, 32, 32, 0),  # no routed rows at all
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference(case, dtype):
    num_rows, num_groups, k_dim, n_dim, num_used = case
    x, w, sizes = random_problem(sum(case), num_rows, num_groups, k_dim, n_dim, num_used, dtype)
    got = np.asarray(grouped_matmul(x, w, sizes, interpret=True), np.float32)
    want = np.asarray(grouped_matmul_reference(x, w, sizes), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[num_used:], 0)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got[:num_used], want[:num_used], rtol=tol, atol=tol)


@pytest.mark.parametrize("block_m", [16, 32])
def test_tiles_shared_by_groups(block_m):
    """Explicit tile sizes: groups that start and end mid-tile, empty groups between them."""
    x, w, _ = random_problem(3, 96, 6, 64, 64, 96, jnp.float32)
    sizes = jnp.asarray([5, 0, 40, 1, 0, 50], jnp.int32)
    got = grouped_matmul(x, w, sizes, block_m=block_m, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(grouped_matmul_reference(x, w, sizes)),
                               rtol=2e-5, atol=2e-5)


def test_reference_is_ragged_dot():
    x, w, sizes = random_problem(7, 48, 5, 32, 24, 41, jnp.float32)
    x = jnp.nan_to_num(x)  # ragged_dot's dense lowering multiplies every row by zeros
    np.testing.assert_allclose(np.asarray(grouped_matmul_reference(x, w, sizes)),
                               np.asarray(jax.lax.ragged_dot(x, w, sizes)), rtol=1e-5, atol=1e-5)


def test_lowers_for_cuda():
    """Prefill-sized (128- and 64-row tiles) and decode-sized (16-row tiles) problems."""
    sds = jax.ShapeDtypeStruct
    for rows in (65536, 8192, 512):
        args = (sds((rows, 2048), jnp.bfloat16), sds((128, 2048, 768), jnp.bfloat16),
                sds((128,), jnp.int32))
        assert "grouped_matmul" in lower_for_h200(grouped_matmul, *args)
        assert "grouped_swiglu" in lower_for_h200(grouped_swiglu, *args[:2], *args[1:])


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_matches_reference(case, dtype):
    """The fused gate/up pass == silu(x @ w_gate) * (x @ w_up) per group; rows past the groups
    zero."""
    num_rows, num_groups, k_dim, n_dim, num_used = case
    x, w_gate, sizes = random_problem(sum(case), num_rows, num_groups, k_dim, n_dim, num_used,
                                      dtype)
    _, w_up, _ = random_problem(sum(case) + 1, num_rows, num_groups, k_dim, n_dim, num_used, dtype)
    got = np.asarray(grouped_swiglu(x, w_gate, w_up, sizes, interpret=True), np.float32)
    want = np.asarray(grouped_swiglu_reference(x, w_gate, w_up, sizes), np.float32)
    separate = jax.nn.silu(grouped_matmul_reference(x, w_gate, sizes).astype(jnp.float32)) * \
        grouped_matmul_reference(x, w_up, sizes).astype(jnp.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[num_used:], 0)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got[:num_used], want[:num_used], rtol=tol, atol=tol)
    np.testing.assert_allclose(want[:num_used], np.asarray(separate)[:num_used], rtol=tol,
                               atol=tol)


def fp8_experts(w):
    """w [G, K, N] -> (float8_e4m3fn values, fp32 scale [G, N]) per (group, output column)."""
    w32 = np.asarray(w, np.float32)
    scale = np.maximum(np.abs(w32).max(axis=1), 1e-12) / 448.0
    values = jnp.asarray(w32 / scale[:, None, :], jnp.float8_e4m3fn)
    return values, jnp.asarray(scale)


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_experts_match_reference(case, dtype):
    """FP8 weights with a scale per (group, column): each tile cast after its load, the
    accumulator scaled; equal to the dequantised reference, and near the 16-bit product."""
    num_rows, num_groups, k_dim, n_dim, num_used = case
    x, w_gate, sizes = random_problem(sum(case), num_rows, num_groups, k_dim, n_dim, num_used,
                                      dtype)
    _, w_up, _ = random_problem(sum(case) + 1, num_rows, num_groups, k_dim, n_dim, num_used, dtype)
    (gate, gate_scale), (up, up_scale) = fp8_experts(w_gate), fp8_experts(w_up)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    got = np.asarray(grouped_matmul(x, gate, sizes, gate_scale, interpret=True), np.float32)
    want = np.asarray(grouped_matmul_reference(x, gate, sizes, gate_scale), np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[num_used:], 0)
    np.testing.assert_allclose(got[:num_used], want[:num_used], rtol=tol, atol=tol)
    plain = np.asarray(grouped_matmul_reference(x, w_gate, sizes), np.float32)[:num_used]
    if num_used:  # FP8's 3 mantissa bits: a few % of the product's scale
        assert np.abs(want[:num_used] - plain).max() < 0.1 * np.abs(plain).max()
    got = np.asarray(grouped_swiglu(x, gate, up, sizes, (gate_scale, up_scale), interpret=True),
                     np.float32)
    want = np.asarray(grouped_swiglu_reference(x, gate, up, sizes, (gate_scale, up_scale)),
                      np.float32)
    np.testing.assert_array_equal(got[num_used:], 0)
    np.testing.assert_allclose(got[:num_used], want[:num_used], rtol=tol, atol=tol)


def test_fp8_experts_lower_for_cuda():
    sds = jax.ShapeDtypeStruct
    for rows in (8192, 512):
        x, w = sds((rows, 2048), jnp.bfloat16), sds((128, 2048, 768), jnp.float8_e4m3fn)
        sizes, scale = sds((128,), jnp.int32), sds((128, 768), jnp.float32)
        assert "grouped_matmul" in lower_for_h200(grouped_matmul, x, w, sizes, scale)
        assert "grouped_swiglu" in lower_for_h200(
            lambda x, g, u, s, a, b: grouped_swiglu(x, g, u, s, (a, b)), x, w, w, sizes, scale,
            scale)
