"""The half2 int4 GEMV candidate (benchmarks/experiments/int4_gemv_half2.py) in interpret mode,
where its PTX blocks run as their jnp twins: against numpy's exact product within the half2
partial sums' roundings, x rows of any magnitude (the power-of-two row scale), and its CUDA
lowering with the inline PTX."""

import functools
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200
from test_int4_gemv import random_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "experiments"))  # the candidates' half2.py
_spec = importlib.util.spec_from_file_location(
    "int4_gemv_half2", os.path.join(ROOT, "benchmarks", "experiments", "int4_gemv_half2.py"))
half2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(half2)

UNIT = {jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11, jnp.float32: 2.0 ** -24}


def check(got, args, q):
    """Against the exact product: the output's rounding, up to four fp16 roundings in a half2
    lane (each under 2^-11 of the lane's |n x| terms), the fp32 sums; and far from the product
    without zero points (their share applied)."""
    x, _, scales, zeros = args
    group = q.shape[0] // scales.shape[0]
    s = np.repeat(np.asarray(scales, np.float64), group, 0)
    z = np.repeat(np.asarray(zeros, np.int64), group, 0)
    x64 = np.asarray(x, np.float64)
    exact = x64 @ ((q - z) * s)
    bound = (UNIT[x.dtype.type] * np.abs(exact) + 2.0 ** -9 * (np.abs(x64) @ (q * s))
             + q.shape[0] * 2.0 ** -23 * (np.abs(x64) @ ((q + z) * s)))
    got64 = np.asarray(got, np.float64)
    assert np.all(np.abs(got64 - exact) <= bound)
    assert np.max(np.abs(got64 - x64 @ (q * s))) > 10 * np.max(bound)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("m,k,n,group,tiles", [
    (1, 128, 200, 32, dict(block_n=64)),  # four groups in a chunk; N ragged
    (3, 384, 200, 64, dict()),
    (1, 1024, 200, 128, dict(splits=3)),
    (2, 1024, 96, 1024, dict(block_n=32, splits=3)),  # one group over chunks and splits
])
def test_candidate_matches_the_exact_product(m, k, n, group, tiles, dtype):
    args, q = random_inputs(m * k + n + group, m, k, n, group, dtype)
    got = half2.int4_gemv_half2(*args, interpret=True, **tiles)
    assert got.shape == (m, n) and got.dtype == dtype
    check(got, args, q)


@pytest.mark.parametrize("magnitude", [3e4, 1e-6])
def test_rows_far_from_unit_scale_neither_overflow_nor_underflow(magnitude):
    """Rows whose products would pass fp16's 65504 (x ~ 3e4, n up to 15) or fall under its
    normal range (x ~ 1e-6) keep the same relative error: the row scale brings them to 2^9."""
    args, q = random_inputs(5, 2, 256, 64, 64, jnp.float32)
    args = (args[0] * magnitude, *args[1:])
    check(half2.int4_gemv_half2(*args, interpret=True), args, q)


@pytest.mark.parametrize("group", [16, 96])
def test_groups_that_do_not_tile_a_chunk_are_refused(group):
    args, _ = random_inputs(0, 1, 384, 32, group, jnp.bfloat16)
    with pytest.raises(ValueError, match="32, 64 or a multiple of 128"):
        half2.int4_gemv_half2(*args, interpret=True)


def test_lowers_for_cuda_with_the_ptx():
    sds = jax.ShapeDtypeStruct
    k, n, group = 4096, 28672, 128
    text = lower_for_h200(functools.partial(half2.int4_gemv_half2), sds((1, k), jnp.bfloat16),
                          sds((k // 8, n), jnp.int32), sds((k // group, n), jnp.bfloat16),
                          sds((k // group, n), jnp.uint8))
    assert "int4_gemv_half2" in text and "triton" in text
