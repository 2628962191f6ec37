"""The block-scaled FP8 matmul (pallas_kernels/fp8_block_matmul.py) against its reference and the
format's definition, and the block-scaled linear's activations quantised per token and group."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import lower_for_h200
from jaxllm.models.quant import Fp8BlockWeight, dequantize, linear, quantize_fp8_groups
from pallas_kernels.fp8_block_matmul import fp8_block_matmul, fp8_block_matmul_reference

FP8 = jnp.float8_e4m3fn


def random_operands(rng, m, k, n, group):
    groups = -(-k // group)
    x = jnp.asarray(rng.standard_normal((m, k)) * 40, FP8)
    w = jnp.asarray(rng.standard_normal((n, k)) * 40, FP8)
    x_scale = jnp.asarray(rng.uniform(1e-3, 1e-1, (m, groups)), jnp.float32)
    w_scale = jnp.asarray(rng.uniform(1e-3, 1e-1, (n, groups)), jnp.float32)
    return x, x_scale, w, w_scale


def definition(x, x_scale, w, w_scale, group):
    """out[m, n] = sum_k x[m, k] x_scale[m, k // group] w[n, k] w_scale[n, k // group], numpy."""
    k = x.shape[1]
    cols = np.arange(k) // group
    xd = np.asarray(x, np.float64) * np.asarray(x_scale, np.float64)[:, cols]
    wd = np.asarray(w, np.float64) * np.asarray(w_scale, np.float64)[:, cols]
    return xd @ wd.T


@pytest.mark.parametrize("m,k,n,group,tiles", [
    (1, 512, 200, 128, {}),                        # decode: K split (default count)
    (5, 300, 70, 128, {}),                         # a partial last group, ragged N
    (37, 256, 130, 64, {"splits": 2}),             # M past one 16-row tile, 2 K splits
    (70, 384, 96, 32, {"block_m": 64, "block_n": 64, "splits": 1}),  # two M tiles, one split
])
def test_kernel_matches_reference_and_definition(m, k, n, group, tiles):
    rng = np.random.default_rng(m * 1000 + k)
    args = random_operands(rng, m, k, n, group)
    want = definition(*args, group)
    ref = fp8_block_matmul_reference(*args, group, jnp.float32)
    got = fp8_block_matmul(*args, group=group, out_dtype=jnp.float32, interpret=True, **tiles)
    scale = np.abs(want).max()
    assert scale > 1
    np.testing.assert_allclose(np.asarray(ref), want, atol=1e-5 * scale)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5 * scale)
    bf16 = fp8_block_matmul(*args, group=group, interpret=True, **tiles)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16, np.float32), want, atol=1e-2 * scale)


def test_kernel_refuses_what_it_cannot_take():
    args = random_operands(np.random.default_rng(0), 4, 96, 32, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8_block_matmul(*args, group=48, interpret=True)
    x, x_scale, w, w_scale = random_operands(np.random.default_rng(0), 4, 256, 32, 128)
    with pytest.raises(ValueError, match=r"scales \[M, 2\] and \[N, 2\]"):
        fp8_block_matmul(x, x_scale, w, w_scale[:, :1], group=128, interpret=True)


def test_groups_quantised_per_token_and_group():
    """Each (token, group) slice scaled by its absolute max / 448 (a partial last group too):
    values within float8's rounding of x / scale, and every group's max reaching 448."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 300)).astype(np.float32) * rng.uniform(0.01, 100, (6, 1))
    values, scale = quantize_fp8_groups(jnp.asarray(x), 128)
    assert values.shape == (6, 300) and scale.shape == (6, 3)
    cols = np.arange(300) // 128
    for g in range(3):
        part = np.abs(x[:, cols == g]).max(axis=1)
        np.testing.assert_allclose(np.asarray(scale[:, g]), part / 448, rtol=1e-6)
        np.testing.assert_allclose(np.abs(np.asarray(values, np.float32)[:, cols == g]).max(1),
                                   448)
    back = np.asarray(values, np.float32) * np.asarray(scale)[:, cols]
    np.testing.assert_allclose(back, x, rtol=2 ** -4, atol=1e-6)


def test_block_linear_is_the_stored_weight_times_grouped_activations():
    """linear(x, Fp8BlockWeight) with two output axes (as gate/up fused) against x quantised per
    group times the dequantised weight, and within FP8's rounding of the exact product."""
    rng = np.random.default_rng(5)
    k, group = 256, 128
    values = jnp.asarray(rng.standard_normal((2, 48, k)) * 40, FP8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, (2, 48, 2)), jnp.float32)
    w = Fp8BlockWeight(values, scale, group)
    assert w.shape == (k, 2, 48)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    got = linear(x, w)
    assert got.shape == (3, 2, 48)
    xq, x_scale = quantize_fp8_groups(x, group)
    xd = np.asarray(xq, np.float32) * np.repeat(np.asarray(x_scale), group, axis=1)
    want = np.einsum("tk,kon->ton", xd, np.asarray(dequantize(w)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    exact = np.einsum("tk,kon->ton", np.asarray(x), np.asarray(dequantize(w)))
    assert np.abs(np.asarray(got) - exact).max() < 0.05 * np.abs(exact).max()


def triton_ir_dots(fn, *args) -> list[str]:
    """The tt.dot lines of the Triton modules that lowering fn(*args) for an H200 makes."""
    modules = []
    lower_for_h200(fn, *args, triton_modules=modules)
    return [line for module in modules for line in module.splitlines() if "tt.dot" in line]


@pytest.mark.parametrize("m", [1, 2048])
def test_kernel_lowers_for_h200_with_fp8_accumulation(m):
    """CUDA lowering, and each float8 dot allowed the tensor core's accumulator over its K
    (the group), without which Triton runs it as fp16 mma.sync (triton_fp8_dot.py)."""
    k, n, group = 4096, 6144, 128
    sds = jax.ShapeDtypeStruct
    args = (sds((m, k), FP8), sds((m, k // group), jnp.float32), sds((n, k), FP8),
            sds((n, k // group), jnp.float32))
    dots = triton_ir_dots(functools.partial(fp8_block_matmul, group=group), *args)
    assert dots and all(f"maxNumImpreciseAcc = {group}" in d and "f8E4M3FN" in d
                        for d in dots), dots


def test_fp8_accumulation_leaves_16_bit_dots_alone():
    """The installed builder adds the setting to float8 dots only, and installing twice wraps
    once."""
    from jax._src.pallas.triton import lowering
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    from pallas_kernels import triton_fp8_dot
    triton_fp8_dot.install()
    dot = lowering.tt_dialect.dot
    assert dot.wraps_fp8_accumulation and not hasattr(dot.__wrapped__, "wraps_fp8_accumulation")

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = pltriton.dot(x_ref[...], w_ref[...])

    def bf16_dot(x, w):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((64, 64), jnp.float32))(x, w)

    sds = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    dots = triton_ir_dots(bf16_dot, sds, sds)
    assert dots and not any("maxNumImpreciseAcc = 64" in d for d in dots), dots
