"""Fused residual add + LayerNorm: the Pallas kernel (interpret mode) against the jnp reference,
the reference against models/bert.py's layer_norm, the kernel's CUDA lowering on this CPU, and
the GPU benchmark's CPU run."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200

from jaxllm.models.bert import layer_norm
from pallas_kernels.layer_norm import add_layer_norm, add_layer_norm_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPS = 1e-12  # BERT's
# |kernel - reference| <= TOL * (1 + |reference|): fp32 leaves the two reduction orders' rounding
# (rows with mean -1000 x their spread amplify it to ~1e-4); 16-bit outputs one rounding step.
TOL = {jnp.float32: 5e-4, jnp.float16: 2.0 ** -10, jnp.bfloat16: 2.0 ** -7}


def random_inputs(seed, num_tokens, hidden, dtype):
    """Rows of spread 0.5, 4 or 32 (large magnitudes: |x| up to ~3e4, near fp16's limit) with
    means 0, 30 or -1000 times their spread (a one-pass variance fails on the last); the
    residual half as spread; weight around 1 and bias around 0, neither trivial."""
    rng = np.random.default_rng(seed)
    spread = rng.choice([0.5, 4.0, 32.0], (num_tokens, 1))
    mean = spread * rng.choice([0.0, 30.0, -1000.0], (num_tokens, 1))
    as_dtype = lambda v: jnp.asarray(v, jnp.float32).astype(dtype)  # noqa: E731
    return (as_dtype(rng.standard_normal((num_tokens, hidden)) * spread + mean),
            as_dtype(rng.standard_normal((num_tokens, hidden)) * spread / 2),
            as_dtype(1 + 0.3 * rng.standard_normal(hidden)),
            as_dtype(0.2 * rng.standard_normal(hidden)))


def one_pass(x, residual, weight, bias, eps):
    """The variance as E[s^2] - mean^2: what the test data must tell apart from two passes."""
    s = x.astype(jnp.float32) + residual.astype(jnp.float32)
    mean = jnp.mean(s, axis=-1, keepdims=True)
    var = jnp.mean(s * s, axis=-1, keepdims=True) - mean * mean
    out = (s - mean) * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32) + bias
    return out.astype(x.dtype)


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("hidden", [384, 768, 100])
def test_pallas_matches_reference(hidden, dtype):
    x, residual, weight, bias = random_inputs(hidden, 37, hidden, dtype)  # 37: no block multiple
    want = add_layer_norm_reference(x, residual, weight, bias, EPS)
    assert want.dtype == dtype
    for block_rows in (None, 8):  # the default, and 8 (5 blocks, the last 3 rows short of full)
        got = add_layer_norm(x, residual, weight, bias, EPS, block_rows=block_rows,
                             interpret=True)
        assert got.dtype == dtype and got.shape == x.shape
        assert_close(got, want, dtype)
    with pytest.raises(AssertionError):  # the data catches a one-pass variance
        assert_close(one_pass(x, residual, weight, bias, EPS), want, dtype)


def test_leading_axes_and_eps():
    """[S, L, H] as bert.py holds it; a large eps (small rows: eps matters) reaches the kernel."""
    x, residual, weight, bias = random_inputs(1, 2 * 19, 64, jnp.bfloat16)
    x, residual = (0.01 * a.reshape(2, 19, 64) for a in (x, residual))
    got = add_layer_norm(x, residual, weight, bias, 1e-3, interpret=True)
    assert got.shape == (2, 19, 64)
    assert_close(got, add_layer_norm_reference(x, residual, weight, bias, 1e-3), jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_reference_is_berts_layer_norm(dtype):
    """Exactly bert.layer_norm of the fp32 sum, cast back."""
    x, residual, weight, bias = random_inputs(2, 37, 384, dtype)
    want = layer_norm(x.astype(jnp.float32) + residual.astype(jnp.float32), weight, bias,
                      EPS).astype(dtype)
    np.testing.assert_array_equal(np.asarray(add_layer_norm_reference(x, residual, weight, bias,
                                                                      EPS), np.float32),
                                  np.asarray(want, np.float32))


@pytest.mark.parametrize("hidden, dtype", [(768, jnp.float16), (100, jnp.bfloat16)])
def test_lowers_for_cuda(hidden, dtype):
    sds = jax.ShapeDtypeStruct
    rows, vector = sds((1000, hidden), dtype), sds((hidden,), dtype)
    fn = functools.partial(add_layer_norm, eps=EPS, block_rows=4, num_warps=8)
    assert "add_layer_norm" in lower_for_h200(fn, rows, rows, vector, vector)


def test_gpu_benchmark_runs_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "experiments",
                                                       "layer_norm_gpu.py"),
                          "--cpu", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "layer_norm_gpu.json") as f:
        result = json.load(f)
    for shape, res in result.items():
        assert (tmp_path / f"xla_layer_norm_{shape}.hlo.txt").exists()
        assert len(res["variants"]) == 4
        for row in res["variants"].values():  # fp16 outputs of |value| < 8: a few 2^-9 roundings
            assert row["max_abs_error_vs_fp32"] < 1e-2 and row["wall_us"] > 0
