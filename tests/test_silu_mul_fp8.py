"""SwiGLU's activation quantised for the FP8 down projection: the Pallas kernel (interpret mode)
against the jnp reference, the reference against numpy (ml_dtypes' float8), the FP8 MLP that
uses it against the unfused path and the float product, and the kernel's CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import lower_for_h200

from jaxllm.models.layers import dense_mlp
from jaxllm.models.quant import (SWIGLU_KERNEL_MIN_TOKENS, fp8_swiglu, fp8_swiglu_applies,
                                 linear, on_one_device, quantize_fp8)
from pallas_kernels.silu_mul_fp8 import silu_mul_fp8, silu_mul_fp8_reference


def random_inputs(seed, num_tokens, width, dtype=jnp.bfloat16):
    """A GEMM's unscaled product (FP8 operands: magnitudes in the hundreds), per-token and
    per-channel scales spanning two decades; one token all zeros (its scale stays finite)."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((num_tokens, 2 * width)) * rng.choice([30.0, 300.0, 3000.0],
                                                                   (num_tokens, 1))
    y[num_tokens // 2] = 0
    x_scale = 10.0 ** rng.uniform(-4, -2, num_tokens)
    w_scale = 10.0 ** rng.uniform(-4, -2, 2 * width)
    return (jnp.asarray(y, jnp.float32).astype(dtype), jnp.asarray(x_scale, jnp.float32),
            jnp.asarray(w_scale, jnp.float32))


def numpy_silu_mul_fp8(y, x_scale, w_scale):
    """The contract from its definition, in float64 then float8 by ml_dtypes."""
    y = np.asarray(y, np.float64) * np.asarray(x_scale)[:, None] * np.asarray(w_scale)[None]
    g, u = np.split(y, 2, axis=1)
    h = g / (1 + np.exp(-g)) * u
    scale = np.maximum(np.abs(h).max(axis=1), 1e-12) / 448
    return np.clip(h / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("num_tokens,width,tiles", [
    (9, 200, dict(block_rows=2, block_cols=64)),  # rows and I ragged against the tiles
    (4, 96, dict(block_rows=1, block_cols=32)),
    (3, 64, dict()),  # one chunk wider than I: the row read once
    (5, 200, dict(block_rows=2, block_cols=256)),  # the same, rows ragged
    (11, 200, dict(block_rows=2, block_cols=64, row_blocks=3)),  # a program's blocks in turn
    (7, 64, dict(block_rows=2, row_blocks=2)),  # the same, the row in one chunk
    (19, 2100, dict()),  # the default chunked tiles: rows past ONE_READ_MAX_WIDTH
])
def test_kernel_matches_reference(num_tokens, width, tiles):
    args = random_inputs(num_tokens, num_tokens, width)
    values, scale = silu_mul_fp8(*args, interpret=True, **tiles)
    want_values, want_scale = silu_mul_fp8_reference(*args)
    assert values.shape == (num_tokens, width) and values.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(np.asarray(scale), np.asarray(want_scale), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(values, np.float32),
                                  np.asarray(want_values, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_reference_matches_numpy(dtype):
    args = random_inputs(1, 8, 160, dtype)
    values, scale = silu_mul_fp8_reference(*args)
    want_values, want_scale = numpy_silu_mul_fp8(*args)
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-5)
    got = np.asarray(values, np.float32)
    want = want_values.astype(np.float32)
    # fp32 against float64 may round a value on the other side of a float8 midpoint: one step
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -6))) - 3)
    assert np.all(np.abs(got - want) <= step)
    assert np.mean(got == want) > 0.99
    assert np.all(got[4] == 0) and np.isfinite(np.asarray(scale)).all()  # the zero token
    assert np.abs(got).max() == 448  # each token's max hits the top of the range


def mlp_inputs(num_tokens):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((num_tokens, 64)), jnp.float32).astype(jnp.bfloat16)
    w_gate_up = quantize_fp8(jnp.asarray(rng.standard_normal((64, 2, 96)) * 0.2, jnp.bfloat16))
    w_down = quantize_fp8(jnp.asarray(rng.standard_normal((96, 64)) * 0.2, jnp.bfloat16))
    return x, w_gate_up, w_down


def unfused_mlp(x, w_gate_up, w_down):
    gate_up = linear(x, w_gate_up)
    return linear(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w_down)


def test_fp8_swiglu_matches_the_unfused_mlp_and_the_float_product():
    """From SWIGLU_KERNEL_MIN_TOKENS tokens (here the kernel's reference, on the CPU)."""
    x, w_gate_up, w_down = mlp_inputs(SWIGLU_KERNEL_MIN_TOKENS + 37)
    got = np.asarray(fp8_swiglu(x, w_gate_up, w_down), np.float32)
    unfused = np.asarray(unfused_mlp(x, w_gate_up, w_down), np.float32)
    deq = lambda w: np.einsum("...k,...->k...", np.asarray(w.values, np.float32),  # noqa: E731
                              np.asarray(w.scale))
    gu = np.einsum("tk,kgo->tgo", np.asarray(x, np.float32), deq(w_gate_up))
    exact = (gu[:, 0] / (1 + np.exp(-gu[:, 0])) * gu[:, 1]) @ deq(w_down)
    err = lambda a: np.linalg.norm(a - exact, axis=1) / np.linalg.norm(exact, axis=1)  # noqa: E731
    # two W8A8 GEMMs of random weights: ~5% from the float product either way; the fused
    # path's fp32 SiLU and product (no bf16 roundings between) are no worse
    assert np.all(err(got) < 0.1) and err(got).mean() <= 1.05 * err(unfused).mean()
    assert np.mean(np.linalg.norm(got - unfused, axis=1) / np.linalg.norm(exact, axis=1)) < 0.03
    assert not np.array_equal(got, unfused)  # the kernel's path, not XLA's


def test_dense_mlp_keeps_xla_below_the_kernel_threshold():
    for num_tokens in (SWIGLU_KERNEL_MIN_TOKENS - 1, SWIGLU_KERNEL_MIN_TOKENS):
        x, w_gate_up, w_down = mlp_inputs(num_tokens)
        got = dense_mlp({"w_gate_up": w_gate_up, "w_down": w_down}, x, None)
        want = (unfused_mlp if num_tokens < SWIGLU_KERNEL_MIN_TOKENS else fp8_swiglu)(
            x, w_gate_up, w_down)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_one_device_only():
    """On a mesh of several devices the MLP keeps XLA's path (the kernel would need the token
    max over a split I)."""
    x, w_gate_up, w_down = mlp_inputs(SWIGLU_KERNEL_MIN_TOKENS)
    assert on_one_device() and fp8_swiglu_applies(x, w_gate_up, w_down)
    mesh = jax.sharding.AbstractMesh((2,), ("tensor",))
    with jax.sharding.use_abstract_mesh(mesh):
        assert not on_one_device() and not fp8_swiglu_applies(x, w_gate_up, w_down)


def test_kernel_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    for tokens, width, dtype, tiles in [(256, 14336, jnp.bfloat16, {}),
                                        (1, 8960, jnp.float32, dict(block_rows=4)),
                                        (2048, 1536, jnp.bfloat16, dict(block_cols=512)),
                                        (512, 14336, jnp.bfloat16,
                                         dict(block_cols=16384, num_warps=16))]:
        text = lower_for_h200(functools.partial(silu_mul_fp8, **tiles),
                              sds((tokens, 2 * width), dtype), sds((tokens,), jnp.float32),
                              sds((2 * width,), jnp.float32))
        assert "silu_mul_fp8" in text


def test_a_row_in_one_chunk_is_read_once(monkeypatch):
    """y's gate and up halves are loaded once a kernel: twice in all when the row is one chunk
    (one kernel), four times when it is wider (the maxima's kernel, then the stores'). Where a
    program takes several blocks (the wide rows' default) each load is in the program twice:
    the first block's before the loop, the next block's in it."""
    from jax._src.pallas.triton import lowering
    modules, lower = [], lowering.lower_jaxpr_to_triton_module
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module",
                        lambda *a, **k: modules.append(lower(*a, **k)) or modules[-1])
    sds = jax.ShapeDtypeStruct

    def y_loads(width):
        modules.clear()
        lower_for_h200(silu_mul_fp8, sds((512, 2 * width), jnp.bfloat16),
                       sds((512,), jnp.float32), sds((2 * width,), jnp.float32))
        return sum("tt.load" in line and "ptr<bf16>" in line
                   for module in modules for line in str(module.module).splitlines())

    assert (y_loads(1536), y_loads(14336)) == (2, 4 * 2)


def test_fp8_mlp_lowers_with_the_kernel_between_two_fp8_dots(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the GPU's path, traced here
    w_gate_up = quantize_fp8(jnp.zeros((512, 2, 768), jnp.bfloat16))
    w_down = quantize_fp8(jnp.zeros((768, 512), jnp.bfloat16))
    shapes = lambda w: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)  # noqa: E731
    text = lower_for_h200(fp8_swiglu,
                          jax.ShapeDtypeStruct((SWIGLU_KERNEL_MIN_TOKENS, 512), jnp.bfloat16),
                          shapes(w_gate_up), shapes(w_down))
    dots = [line for line in text.splitlines() if "dot_general" in line and "f8E4M3FN" in line]
    assert len(dots) == 2 and all("xbf16>" in d.split("->")[-1] for d in dots), dots
    assert "silu_mul_fp8" in text


def numpy_silu_mul_static(y, x_scale, w_scale, static_scale):
    """A static scale's contract from its definition: h over the one scale, saturated."""
    y = np.asarray(y, np.float64) * np.asarray(x_scale)[:, None] * np.asarray(w_scale)[None]
    g, u = np.split(y, 2, axis=1)
    h = g / (1 + np.exp(-g)) * u
    return np.clip(h / static_scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("num_tokens,width,tiles", [
    (9, 200, dict(block_rows=2, block_cols=64)),  # chunked, rows and I ragged
    (11, 200, dict(block_rows=2, block_cols=64, row_blocks=3)),
    (5, 96, dict()),  # the row in one chunk
    (19, 2100, dict()),  # the default chunked tiles: one kernel all the same
])
def test_static_scale_matches_reference_and_saturates(num_tokens, width, tiles):
    """A static scale (vLLM's activation_scheme static) at the median |h|: half of h is past
    448 times it and saturates; every token's scale is the static one, whatever its own max."""
    args = random_inputs(num_tokens + 3, num_tokens, width)
    h_abs = np.abs(np.asarray(silu_mul_fp8_reference(*args)[0], np.float32)
                   * np.asarray(silu_mul_fp8_reference(*args)[1])[:, None])
    static = jnp.float32(np.median(h_abs[h_abs > 0]) / 448)
    values, scale = silu_mul_fp8(*args, static, interpret=True, **tiles)
    want_values, want_scale = silu_mul_fp8_reference(*args, static)
    np.testing.assert_array_equal(np.asarray(scale), np.full(num_tokens, static))
    np.testing.assert_array_equal(np.asarray(want_scale), np.full(num_tokens, static))
    got = np.asarray(values, np.float32)
    np.testing.assert_array_equal(got, np.asarray(want_values, np.float32))
    want = numpy_silu_mul_static(*args, float(static)).astype(np.float32)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 2.0 ** -6))) - 3)
    assert np.all(np.abs(got - want) <= step) and np.mean(got == want) > 0.99
    assert 0.3 < np.mean(np.abs(got) == 448) < 0.7  # saturated, not wrapped or inf


def test_static_scale_reads_its_layer_of_a_stack():
    args = random_inputs(5, 13, 200)
    stack = jnp.asarray([0.5, 0.02, 7.0], jnp.float32)
    values, scale = silu_mul_fp8(*args, stack, static_layer=1, block_rows=4, block_cols=64,
                                 interpret=True)
    want_values, _ = silu_mul_fp8_reference(*args, stack[1])
    np.testing.assert_array_equal(np.asarray(scale), np.full(13, 0.02, np.float32))
    np.testing.assert_array_equal(np.asarray(values, np.float32),
                                  np.asarray(want_values, np.float32))


def test_a_static_scale_reads_the_row_once(monkeypatch):
    """With a static scale no row max is needed: y's halves are loaded by one kernel at any I
    (twice each where a program takes several blocks: test_a_row_in_one_chunk_is_read_once)."""
    from jax._src.pallas.triton import lowering
    modules, lower = [], lowering.lower_jaxpr_to_triton_module
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module",
                        lambda *a, **k: modules.append(lower(*a, **k)) or modules[-1])
    sds = jax.ShapeDtypeStruct
    lower_for_h200(functools.partial(silu_mul_fp8, layer=5, static_layer=5),
                   sds((2048, 2 * 14336), jnp.bfloat16), sds((2048,), jnp.float32),
                   sds((32, 2 * 14336), jnp.float32), sds((32,), jnp.float32))
    loads = sum("tt.load" in line and "ptr<bf16>" in line
                for module in modules for line in str(module.module).splitlines())
    assert len(modules) == 1 and loads == 2 * 2
