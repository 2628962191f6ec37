"""The half2 GEMV's (int4_gemv.py) PTX helpers: a half2 lane widened to fp32, and the
power-of-two row scale that keeps x's fp16 products in range."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ptx import asm

# $0 <- the lo (l) or hi (h) half of half2 $1, as fp32
_WIDEN_PTX = "{{ .reg .b16 l, h; mov.b32 {{l, h}}, $1; cvt.f32.f16 $0, {}; }}"


def widen(v: jax.Array, half: str) -> jax.Array:
    """The lo (half "l") or hi ("h") fp16 of the half2 bits v (int32), as fp32."""
    return asm(_WIDEN_PTX.format(half), jnp.float32, "=f,r", v)


def pow2_scale(top: jax.Array, x_top: int) -> jax.Array:
    """The power of two (fp32) taking a positive top into [2^x_top, 2^(x_top + 1)), by its
    exponent bits (in a kernel as in jnp); clamped to fp32's normal powers."""
    exponent = (jax.lax.bitcast_convert_type(top, jnp.int32) >> 23) & 0xFF
    return jax.lax.bitcast_convert_type(jnp.clip(127 + x_top + 127 - exponent, 1, 254) << 23,
                                        jnp.float32)
