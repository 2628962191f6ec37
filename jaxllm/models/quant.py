"""Quantised linear weights, and `linear(x, w)`: the one projection every layer calls.

A weight is a plain array [K, *out] (x [T, K] contracts its first axis) or one of:
  Fp8Weight  values [*out, K] float8_e4m3fn, scale [*out] float32: w[k, o] = values[o, k] * scale[o]
             (per output channel; K minor, the operand layout Hopper's FP8 GEMMs read). Run as
             W8A8: activations quantised per token on the fly, one FP8 x FP8 dot accumulating
             in fp32, then both scales.
  Int4Weight W4A16 (GPTQ/AWQ checkpoints, pallas_kernels/quant_matmul.py has the layout):
             qweight [K // 8, *out] int32, scales and zeros [K // group, *out], and `perm` [K]
             (GPTQ's act order: x's columns are gathered so each group's rows are contiguous).
`map_out(fn, ws)` applies a layout change of the output axes (models/fused.py's concatenation
of q/k/v and stacking of gate/up) to plain and quantised weights alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import quant_matmul
from pallas_kernels.quant_matmul import CHUNK_ROWS as INT4_CHUNK_ROWS, pack_int4  # noqa: F401 (loaders)

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row or channel keeps a finite scale


@jax.tree_util.register_dataclass
@dataclass
class Fp8Weight:
    values: jax.Array  # [*out, K] float8_e4m3fn
    scale: jax.Array  # [*out] float32

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [K, *out] shape, as the plain weight it stands for."""
        return (self.values.shape[-1], *self.values.shape[:-1])


@jax.tree_util.register_dataclass
@dataclass
class Int4Weight:
    qweight: jax.Array  # [Kp // 8, *out] int32, quant_matmul's packing, K zero-padded to Kp
    scales: jax.Array  # [Kp // group, *out] compute dtype (0 on the padding rows)
    zeros: jax.Array  # [Kp // group, *out] uint8
    perm: jax.Array | None = None  # [K] int32: x[:, perm] before the product (act order)
    in_features: int = field(default=0, metadata=dict(static=True))  # K

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.in_features, *self.qweight.shape[1:])


QUANTIZED = (Fp8Weight, Int4Weight)


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED)


def linear(x: jax.Array, w) -> jax.Array:
    """x [T, K] @ w [K, *out] -> [T, *out] in x's dtype, for any weight kind above."""
    if isinstance(w, Fp8Weight):
        return _fp8_linear(x, w)
    if isinstance(w, Int4Weight):
        return _int4_linear(x, w)
    return jnp.tensordot(x, w, axes=1)


def _fp8_linear(x: jax.Array, w: Fp8Weight) -> jax.Array:
    out_shape = w.values.shape[:-1]
    xq, x_scale = quantize_fp8_rows(x)
    y = jax.lax.dot_general(xq, w.values.reshape(-1, x.shape[-1]), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # [T, N]
    y = y * x_scale * w.scale.reshape(-1)
    return y.astype(x.dtype).reshape(x.shape[0], *out_shape)


def _int4_linear(x: jax.Array, w: Int4Weight) -> jax.Array:
    out_shape = w.qweight.shape[1:]
    if w.perm is not None:
        x = x[:, w.perm]
    x = jnp.pad(x, ((0, 0), (0, 8 * w.qweight.shape[0] - x.shape[1])))
    matmul = (quant_matmul.int4_matmul if jax.default_backend() == "gpu"
              else quant_matmul.int4_matmul_reference)
    flat = lambda a: a.reshape(a.shape[0], -1)
    y = matmul(x, flat(w.qweight), flat(w.scales), flat(w.zeros))
    return y.reshape(x.shape[0], *out_shape)


def quantize_fp8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (float8_e4m3fn [T, K], fp32 scale [T, 1]): x ~ values * scale, per token."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    scale = jnp.maximum(amax, _MIN_SCALE) / FP8_MAX
    return jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


@jax.jit
def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """w [K, *out] -> Fp8Weight with one scale per output channel (its absolute max / 448)."""
    k, out_shape = w.shape[0], w.shape[1:]
    flat = w.astype(jnp.float32).reshape(k, -1)
    scale = jnp.maximum(jnp.max(jnp.abs(flat), axis=0), _MIN_SCALE) / FP8_MAX  # [N]
    values = jnp.clip(flat / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return Fp8Weight(values.T.reshape(*out_shape, k), scale.reshape(out_shape))


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    """The plain [K, *out] matrix a weight stands for (tests, references)."""
    if isinstance(w, Fp8Weight):
        values = jnp.moveaxis(w.values, -1, 0).astype(jnp.float32)
        return (values * w.scale).astype(dtype)
    if isinstance(w, Int4Weight):
        flat = lambda a: a.reshape(a.shape[0], -1)
        dense = quant_matmul.dequantize_int4(flat(w.qweight), flat(w.scales), flat(w.zeros))
        dense = dense[:w.in_features]
        if w.perm is not None:  # row i of the packed matrix is input row perm[i]
            dense = jnp.zeros_like(dense).at[w.perm].set(dense)
        return dense.reshape(w.shape).astype(dtype)
    return w.astype(dtype)


def map_out(fn: Callable[..., jax.Array], ws: list):
    """fn(*arrays) over the output axes of several weights of one kind (each array's leading
    axes are kept as they are, its last is an output axis): plain arrays, or the arrays of
    quantised weights that carry output axes; a weight's `perm` must be shared and is kept."""
    first = ws[0]
    if isinstance(first, Fp8Weight):
        values = fn(*(jnp.moveaxis(w.values, -1, 0) for w in ws))
        return Fp8Weight(jnp.moveaxis(values, 0, -1), fn(*(w.scale for w in ws)))
    if isinstance(first, Int4Weight):
        return Int4Weight(fn(*(w.qweight for w in ws)), fn(*(w.scales for w in ws)),
                          fn(*(w.zeros for w in ws)), first.perm, first.in_features)
    return fn(*ws)


# The projections quantised: attention, the dense MLP, Qwen2-MoE's shared expert. Embedding, LM
# head, router and MoE experts keep the model dtype (vLLM also leaves the LM head unquantised).
QUANTIZED_NAMES = ("wqkv", "wo", "w_gate_up", "w_down", "shared_gate", "shared_up",
                   "shared_down")


def quantize_params_fp8(params: dict) -> dict:
    """Compute-layout params -> FP8 projections, layer by layer; each 16-bit matrix is freed
    once quantised, so the peak is the 16-bit model plus one layer."""
    layers = []
    for layer in params["layers"]:
        quantized = dict(layer)
        for name in QUANTIZED_NAMES:
            if name in layer and not is_quantized(layer[name]):
                quantized[name] = quantize_fp8(layer[name])
                layer[name].delete()
        layers.append(quantized)
    return {**params, "layers": layers}
