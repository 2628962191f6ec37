"""The half2 FP8 GEMV candidate (benchmarks/experiments/fp8_gemv_half2.py) in interpret mode,
where its PTX runs as its jnp twin: against the reference within the half2 sums' roundings, rows
of x at any magnitude (the power-of-two row scale), and its CUDA lowering with the inline PTX."""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200
from test_fp8_gemv import RTOL, random_inputs

from pallas_kernels.fp8_gemv import FP8, fp8_gemv_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "fp8_gemv_half2", os.path.join(ROOT, "benchmarks", "experiments", "fp8_gemv_half2.py"))
half2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(half2)


def check(got, x, values, scale):
    """Against the fp32 reference: the output's rounding and, per half2 lane, up to
    2 * _TILES_PER_WIDEN fp16 roundings (each under 2^-11 of the lane's |w x| sum)."""
    want = np.asarray(fp8_gemv_reference(x, values, scale), np.float64)
    terms = (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(values, np.float64)).T
             * np.asarray(scale, np.float64))
    roundings = 2 * half2._TILES_PER_WIDEN
    bound = RTOL[x.dtype.type] * np.abs(want) + roundings * 2.0 ** -11 * terms
    got64 = np.asarray(got, np.float64)
    assert np.all(np.abs(got64 - want) <= bound)
    assert np.max(np.abs(got64 - want)) < 0.01 * np.max(np.abs(want))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,n,k,tiles", [
    (1, 200, 320, dict(block_n=32, block_k=64)),  # N and K ragged against the tiles
    (3, 70, 1000, dict(block_n=16, block_k=128, splits=3)),
    (1, 300, 2048, dict()),  # the defaults: 8 tiles, two widenings
    (2, 48, 520, dict(block_n=32, block_k=64, splits=4)),
])
def test_candidate_matches_reference(m, n, k, tiles, dtype):
    x, values, scale = random_inputs(m + n + k, m, n, k, dtype)
    got = half2.fp8_gemv_half2(x, values, scale, interpret=True, **tiles)
    assert got.shape == (m, n) and got.dtype == dtype
    check(got, x, values, scale)


@pytest.mark.parametrize("magnitude", [3e3, 1e-6])
def test_rows_far_from_unit_scale(magnitude):
    x, values, scale = random_inputs(3, 2, 40, 512, jnp.float32)
    x = x * magnitude
    check(half2.fp8_gemv_half2(x, values, scale, interpret=True), x, values, scale)


def test_k_not_a_multiple_of_4_is_refused():
    x, values, scale = random_inputs(0, 1, 32, 66)
    with pytest.raises(ValueError, match="K % 4"):
        half2.fp8_gemv_half2(x, values, scale, interpret=True)


def test_lowers_for_cuda_with_the_ptx():
    sds = jax.ShapeDtypeStruct
    text = lower_for_h200(functools.partial(half2.fp8_gemv_half2), sds((1, 4096), jnp.bfloat16),
                          sds((28672, 4096), FP8), sds((28672,), jnp.float32))
    assert "fp8_gemv_half2" in text and "triton" in text
