"""Elementwise inline PTX in Pallas (Triton) kernels, and the approximate fp32 exp2 and
reciprocal: one instruction each on sm_90 (denormals flushed), where Triton lowers jnp.exp2 with
a denormal range fix-up and a division exactly (with a Newton step).
Softmax weights and SiLU are rounded to 16 bits or float8 after, far above either's error
(about 2 ulp of fp32). In interpret mode (the CPU) jnp stands in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton


def asm(ptx: str, out_dtype, constraints: str, *args: jax.Array) -> jax.Array:
    """One result of `ptx` applied element by element to args (all of one shape)."""
    [out] = pltriton.elementwise_inline_asm(
        ptx, args=list(args), constraints=constraints, pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, out_dtype)])
    return out


def exp2(x: jax.Array, interpret: bool) -> jax.Array:
    """2^x of fp32 x."""
    if interpret:
        return jnp.exp2(x)
    return asm("ex2.approx.ftz.f32 $0, $1;", jnp.float32, "=f,f", x)


def reciprocal(x: jax.Array, interpret: bool) -> jax.Array:
    """1 / x of fp32 x."""
    if interpret:
        return 1 / x
    return asm("rcp.approx.ftz.f32 $0, $1;", jnp.float32, "=f,f", x)
