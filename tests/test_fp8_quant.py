"""Per-token FP8 activation quantisation, with and without the input RMSNorm before it
(pallas_kernels/fp8_quant.py): the kernel (interpret mode) against its jnp reference on ragged
rows and widths and stacked norm weights with poisoned rows, the reference against numpy from
the definition (HF's norm roundings, ml_dtypes' float8), the model's routing (W8A8 on one GPU
through the kernel, norm inside; meshes and the CPU in jnp), and the CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import lower_for_h200

from jaxllm.models import quant
from jaxllm.models.layer_stacks import Row
from pallas_kernels import fp8_quant as fq
from pallas_kernels.fp8_quant import (FP8, fp8_quant, fp8_quant_reference, fp8_quant_residual,
                                      fp8_quant_residual_reference)


def random_rows(seed, num_rows, hidden, dtype=jnp.bfloat16):
    """Rows of magnitudes over three decades (one all zeros), a norm weight around 1."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_rows, hidden)) * rng.choice([0.01, 1.0, 30.0], (num_rows, 1))
    x[min(2, num_rows - 1)] = 0.0
    weight = rng.uniform(0.3, 2.0, hidden)
    return jnp.asarray(x, dtype), jnp.asarray(weight, dtype)


def assert_matches(got, want):
    """Scales to fp32 rounding; values equal but where the fp32 sum of squares, summed in
    another order, moved a normalised value across a rounding of x's dtype: then within two
    float8 steps, and rarely."""
    (values, scale), (want_values, want_scale) = got, want
    # a flipped max: one unit of bf16
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=2.0 ** -7)
    a, b = np.asarray(values, np.float32), np.asarray(want_values, np.float32)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), 2.0 ** -6))) - 3)
    assert np.all(np.abs(a - b) <= 2 * step) and np.mean(a == b) > 0.98


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("num_rows,hidden,tiles", [
    (5, 200, dict(block_rows=2)),  # rows and H ragged against the tile
    (7, 576, dict()),  # the default model's width
    (3, 4096, dict(num_warps=8)),
])
@pytest.mark.parametrize("norm", [False, True])
def test_kernel_matches_reference(num_rows, hidden, tiles, dtype, norm):
    x, weight = random_rows(num_rows + hidden, num_rows, hidden, dtype)
    weight = weight if norm else None
    got = fp8_quant(x, weight, eps=1e-5, interpret=True, **tiles)
    assert got[0].shape == (num_rows, hidden) and got[0].dtype == FP8
    assert got[1].shape == (num_rows,) and got[1].dtype == jnp.float32
    assert_matches(got, fp8_quant_reference(x, weight, 1e-5))
    assert np.all(np.asarray(got[0], np.float32)[2] == 0) and np.isfinite(got[1]).all()


def test_kernel_reads_its_row_of_a_stacked_norm_weight():
    x, weight = random_rows(1, 4, 300)
    stack = jnp.stack([jnp.full_like(weight, jnp.nan), weight, jnp.full_like(weight, jnp.nan)])
    got = fp8_quant(x, stack, eps=1e-5, layer=1, interpret=True)
    want = fp8_quant(x, weight, eps=1e-5, interpret=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="layer"):
        fp8_quant(x, stack, eps=1e-5, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        fp8_quant(x, weight.astype(jnp.float32), eps=1e-5, interpret=True)


def residual_inputs(seed, num_rows, hidden, dtype=jnp.bfloat16):
    """An FP8 GEMM's unscaled product (magnitudes in the hundreds), its token and channel
    scales, and a residual stream of rows over three decades."""
    rng = np.random.default_rng(seed)
    y = jnp.asarray(rng.standard_normal((num_rows, hidden)) * 300, jnp.float32).astype(dtype)
    y_scale = jnp.asarray(10.0 ** rng.uniform(-4, -2, num_rows), jnp.float32)
    w_scale = jnp.asarray(10.0 ** rng.uniform(-4, -2, hidden), jnp.float32)
    residual, weight = random_rows(seed + 1, num_rows, hidden, dtype)
    return y, y_scale, w_scale, residual, weight


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("num_rows,hidden,tiles", [(5, 200, dict(block_rows=2)), (7, 576, {})])
@pytest.mark.parametrize("norm", [False, True])
def test_residual_kernel_matches_reference(num_rows, hidden, tiles, dtype, norm):
    """The new stream bit for bit in 16 bits (the product rounded to the stream's dtype, then
    the add rounded, as XLA rounds them; fp32 within an ulp of the products' order); its
    values and scales as fp8_quant's of that stream."""
    y, y_scale, w_scale, residual, weight = residual_inputs(num_rows, num_rows, hidden, dtype)
    weight = weight if norm else None
    x, *got = fp8_quant_residual(y, y_scale, w_scale, residual, weight, eps=1e-5,
                                 interpret=True, **tiles)
    want_x, *want = fp8_quant_residual_reference(y, y_scale, w_scale, residual, weight, 1e-5)
    xla_x = jax.jit(lambda r, y: r + quant._fp8_scaled(y, y_scale[:, None], w_scale, dtype))(
        residual, y)  # the step's own add, compiled
    assert x.dtype == dtype and got[0].dtype == FP8
    ulp = 2.0 ** -23 * float(np.abs(np.asarray(x)).max()) if dtype == jnp.float32 else 0
    for other in (want_x, xla_x):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(other, np.float32),
                                   rtol=0, atol=ulp)
    assert_matches(got, want)
    assert_matches(got, fp8_quant(x, weight, eps=1e-5, interpret=True))


def test_residual_kernel_reads_its_rows_of_stacked_scales_and_norms():
    """The down projection's scales are one layer's, the next input norm the next layer's."""
    y, y_scale, w_scale, residual, weight = residual_inputs(3, 4, 300)
    nan = lambda a: jnp.full_like(a, jnp.nan)  # noqa: E731
    scales, norms = jnp.stack([nan(w_scale), w_scale, nan(w_scale)]), jnp.stack(
        [nan(weight), nan(weight), weight])
    got = fp8_quant_residual(y, y_scale, scales, residual, norms, eps=1e-5, scale_layer=1,
                             norm_layer=2, interpret=True)
    want = fp8_quant_residual(y, y_scale, w_scale, residual, weight, eps=1e-5, interpret=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="layer"):
        fp8_quant_residual(y, y_scale, scales, residual, weight, eps=1e-5, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_matches_numpy(dtype):
    """From the definition: HF's RMSNorm (normalised in fp32, rounded to x's dtype, times the
    weight, rounded), then max |h| / 448 and h / scale to float8 (round to nearest even)."""
    x, weight = random_rows(9, 6, 256, dtype)
    values, scale = fp8_quant_reference(x, weight, 1e-5)
    np_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
    x32 = np.asarray(x, np.float32)
    normed = (x32 / np.sqrt(np.mean(x32 * x32, axis=1, keepdims=True) + 1e-5)).astype(np_dtype)
    h = (normed.astype(np.float32) * np.asarray(weight, np.float32)).astype(np_dtype)
    h = h.astype(np.float32)
    want_scale = np.maximum(np.abs(h).max(axis=1), 1e-12) / 448
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-6)
    want = np.clip(h / want_scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    got = np.asarray(values, np.float32)
    agree = np.mean(got == want.astype(np.float32))
    assert agree > 0.99 and np.abs(got).max() == 448  # each row's max hits the top


def test_w8a8_runs_the_kernel_on_one_gpu_norm_inside(monkeypatch):
    """The GPU's path traced here: norm_linear of more tokens than the GEMV takes is the kernel
    (the norm weight passed in) and one FP8 dot; plain linear the kernel without a norm; on a
    mesh of two devices XLA's quantisation."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w = quant.quantize_fp8(jnp.asarray(np.random.default_rng(0).normal(size=(64, 96)) * 0.2,
                                       jnp.bfloat16))
    x, weight = random_rows(2, 8, 64)
    calls = []
    real = fq.fp8_quant

    def recorded(x, norm_weight=None, **kw):
        calls.append(None if norm_weight is None else norm_weight.shape)
        return real(x, norm_weight, interpret=True, **kw)
    monkeypatch.setattr(fq, "fp8_quant", recorded)
    got = quant.norm_linear(x, weight, 1e-5, w)
    assert calls == [(64,)]
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    want = quant.norm_linear(x, weight, 1e-5, w)  # jnp: the norm, then the quantisation
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=0.02, atol=0.02 * float(np.abs(np.asarray(want)).max()))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    stacked = Row(jnp.stack([weight, weight * 2]), 1)
    quant.norm_linear(x, stacked, 1e-5, w)
    quant.linear(x, w)
    assert calls == [(64,), (2, 64), None]
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("tensor",))):
        jax.make_jaxpr(lambda x: quant.norm_linear(x, weight, 1e-5, w))(x)
    assert len(calls) == 3


def test_kernel_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    for rows, hidden, dtype, norm, kw in [(512, 4096, jnp.bfloat16, True, {}),
                                          (2048, 4096, jnp.bfloat16, False, {}),
                                          (16, 8192, jnp.float32, True, dict(num_warps=8)),
                                          (3, 576, jnp.float16, True, dict(layer=29))]:
        weight = (sds(((30,) if "layer" in kw else ()) + (hidden,), dtype),) if norm else ()
        text = lower_for_h200(functools.partial(fp8_quant, eps=1e-5, **kw),
                              sds((rows, hidden), dtype), *weight)
        assert "fp8_quant" in text
    text = lower_for_h200(functools.partial(fp8_quant_residual, eps=1e-5, scale_layer=3,
                                            norm_layer=4),
                          sds((512, 4096), jnp.bfloat16), sds((512,), jnp.float32),
                          sds((32, 4096), jnp.float32), sds((512, 4096), jnp.bfloat16),
                          sds((32, 4096), jnp.bfloat16))
    assert "fp8_quant_residual" in text


def test_one_token_with_a_norm_of_another_dtype_keeps_the_gemv(monkeypatch):
    """norm_linear's one-token FP8 projection whose norm weight is not x's dtype normalises
    apart and still runs the GEMV (not W8A8)."""
    calls = []
    def call(name):
        return lambda x, w, *a, **k: calls.append(name) or jnp.zeros((x.shape[0], 32), x.dtype)

    monkeypatch.setattr(quant, "_fp8_w8a8", call("w8a8"))
    monkeypatch.setattr(quant, "_fp8_gemv", call("gemv"))
    w = quant.quantize_fp8(jnp.ones((64, 32), jnp.bfloat16))
    x, weight = random_rows(4, 1, 64)
    quant.norm_linear(x, weight.astype(jnp.float32), 1e-5, w)
    quant.norm_linear(x, weight, 1e-5, w)
    quant.norm_linear(jnp.concatenate([x, x]), weight.astype(jnp.float32), 1e-5, w)
    assert calls == ["gemv", "gemv", "w8a8"]


def static_of(x, weight, fraction):
    """A static scale that saturates about `fraction` of the normalised rows' |h|."""
    values, scale = fp8_quant_reference(x, weight, 1e-5)
    h = np.abs(np.asarray(values, np.float32) * np.asarray(scale)[:, None])
    return jnp.float32(np.quantile(h[h > 0], 1 - fraction) / 448)


@pytest.mark.parametrize("num_rows,hidden,tiles", [(5, 200, dict(block_rows=2)), (7, 576, {})])
@pytest.mark.parametrize("norm", [False, True])
def test_static_scale_kernels_match_reference(num_rows, hidden, tiles, norm):
    """vLLM's static activation scheme: every row at the one scale (rows over three decades,
    so some saturate at +-448 and some round to small values), values as the reference's and
    as numpy's clip and cast; the residual kernel's stream unchanged by it."""
    x, weight = random_rows(num_rows * 7, num_rows, hidden)
    weight = weight if norm else None
    static = static_of(x, weight, 0.2)
    values, scale = fp8_quant(x, weight, static, eps=1e-5, interpret=True, **tiles)
    want = fp8_quant_reference(x, weight, 1e-5, static)
    np.testing.assert_array_equal(np.asarray(scale), np.full(num_rows, static))
    assert_matches((values, scale), want)
    h = np.asarray(x if weight is None else fq.rms_norm_reference(x, weight, 1e-5), np.float32)
    numpy = np.clip(h / float(static), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    got = np.asarray(values, np.float32)
    assert np.mean(got == numpy.astype(np.float32)) > 0.98
    assert 0.1 < np.mean(np.abs(got[np.abs(h) > 0]) == 448) < 0.3
    y, y_scale, w_scale, residual, _ = residual_inputs(num_rows, num_rows, hidden)
    stream, *got = fp8_quant_residual(y, y_scale, w_scale, residual, weight, static, eps=1e-5,
                                      interpret=True, **tiles)
    want_stream, *want = fp8_quant_residual_reference(y, y_scale, w_scale, residual, weight,
                                                      1e-5, static)
    np.testing.assert_array_equal(np.asarray(stream, np.float32),
                                  np.asarray(want_stream, np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.full(num_rows, static))
    assert_matches(got, want)


def test_static_scale_reads_its_layer_of_a_stack():
    x, weight = random_rows(5, 6, 300)
    stack = jnp.asarray([jnp.nan, 0.01, jnp.nan], jnp.float32)
    got = fp8_quant(x, weight, stack, eps=1e-5, static_layer=1, interpret=True)
    want = fp8_quant(x, weight, stack[1], eps=1e-5, interpret=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    y, y_scale, w_scale, residual, _ = residual_inputs(6, 6, 300)
    got = fp8_quant_residual(y, y_scale, w_scale, residual, weight, stack, eps=1e-5,
                             static_layer=1, interpret=True)
    want = fp8_quant_residual(y, y_scale, w_scale, residual, weight, stack[1], eps=1e-5,
                              interpret=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="layer"):
        fp8_quant(x, weight, stack, eps=1e-5, interpret=True)


def test_static_w8a8_passes_its_input_scale_to_the_kernel(monkeypatch):
    """The GPU's path traced here: an Fp8Weight with an input_scale (a stacked Row too) gives
    the kernel that scale; the result matches the CPU's jnp path (the same clip and cast)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    w = quant.quantize_fp8(jnp.asarray(np.random.default_rng(0).normal(size=(64, 96)) * 0.2,
                                       jnp.bfloat16))
    x, weight = random_rows(3, 8, 64)
    w.input_scale = static_of(x, weight, 0.1)
    calls = []
    real = fq.fp8_quant

    def recorded(x, norm_weight=None, static_scale=None, **kw):
        calls.append((static_scale, kw.get("static_layer")))
        return real(x, norm_weight, static_scale, interpret=True, **kw)
    monkeypatch.setattr(fq, "fp8_quant", recorded)
    got = quant.norm_linear(x, weight, 1e-5, w)
    assert calls == [(w.input_scale, None)]
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    want = quant.norm_linear(x, weight, 1e-5, w)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=0.02, atol=0.02 * float(np.abs(np.asarray(want)).max()))
    dynamic = quant.norm_linear(x, weight, 1e-5, quant.Fp8Weight(w.values, w.scale))
    assert not np.array_equal(np.asarray(want), np.asarray(dynamic))  # the scale was used
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    stack = jnp.stack([w.input_scale * 3, w.input_scale])
    quant.norm_linear(x, weight, 1e-5, quant.Fp8Weight(w.values, w.scale, Row(stack, 1)))
    assert calls[1][1] == 1 and calls[1][0].shape == (2,)


def test_static_kernels_lower_for_cuda():
    sds = jax.ShapeDtypeStruct
    text = lower_for_h200(functools.partial(fp8_quant, eps=1e-5, layer=4, static_layer=4),
                          sds((2048, 4096), jnp.bfloat16), sds((32, 4096), jnp.bfloat16),
                          sds((32,), jnp.float32))
    assert "fp8_quant" in text
    text = lower_for_h200(functools.partial(fp8_quant, eps=1e-5),
                          sds((3, 576), jnp.bfloat16), None, sds((), jnp.float32))
    assert "fp8_quant" in text
    text = lower_for_h200(functools.partial(fp8_quant_residual, eps=1e-5, scale_layer=3,
                                            norm_layer=4, static_layer=4),
                          sds((512, 4096), jnp.bfloat16), sds((512,), jnp.float32),
                          sds((32, 4096), jnp.float32), sds((512, 4096), jnp.bfloat16),
                          sds((32, 4096), jnp.bfloat16), sds((32,), jnp.float32))
    assert "fp8_quant_residual" in text
