"""Building blocks shared by every decoder: RMSNorm, rotary embedding, the MLPs."""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.args import ModelArgs
from jaxllm.models.quant import (fp8_swiglu, fp8_swiglu_applies, linear, norm_linear, rms_norm,
                                 swiglu_linear)
from pallas_kernels import kv_write


def rope_inv_freq(args: ModelArgs) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies, with linear or llama3 scaling (static)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    if args.rope_type == "linear":
        return inv_freq / args.rope_factor
    if args.rope_type == "llama3":
        return _llama3_scaling(inv_freq, args)
    return inv_freq


def _llama3_scaling(inv_freq: np.ndarray, args: ModelArgs) -> np.ndarray:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len, factor = args.rope_original_max_position, args.rope_factor
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, args: ModelArgs) -> tuple[jax.Array, jax.Array]:
    """positions [T] -> cos, sin [T, 1, head_dim // 2] float32."""
    inv_freq = jnp.asarray(rope_inv_freq(args), jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, D], HF's half-split layout (rotate_half), computed in fp32: the fused rope
    and KV write's reference (pallas_kernels/kv_write.py), so both paths round alike."""
    return kv_write.rope_reference(x, cos, sin)


def dense_mlp(layer: dict, x: jax.Array, args: ModelArgs, lora=None,
              norm_weight: jax.Array | None = None, quantized=None, unscaled: bool = False):
    """SwiGLU: x [T, H] -> [T, H], gate and up in one GEMM over the fused w_gate_up [H, 2, I].
    lora: a models.lora.TokenLoRA, whose updates add onto both projections. norm_weight: x is
    still to be RMS-normalised (with it), a prologue of the gate/up GEMM where one fits
    (quant.norm_linear, fp8_swiglu); normalised first where the normalised x is needed whole
    (LoRA's updates). quantized: x's norm already quantised for an FP8 gate/up GEMM
    (quant.residual_norm_quant's). silu(gate) * up is the down GEMM's prologue where one fits
    (quant.swiglu_linear). unscaled: without LoRA, an FP8 down GEMM's output may come back as
    a quant.ScaledProduct (the residual add waits for the next norm's kernel)."""
    w_gate_up, w_down = layer["w_gate_up"], layer["w_down"]
    if lora is None and fp8_swiglu_applies(x, w_gate_up, w_down):
        norm = () if norm_weight is None else (norm_weight, args.rms_norm_eps)
        return fp8_swiglu(x, w_gate_up, w_down, *norm, quantized=quantized, unscaled=unscaled)
    if norm_weight is not None and lora is not None:
        x, norm_weight = rms_norm(x, norm_weight, args.rms_norm_eps), None
    gate_up = (linear(x, w_gate_up) if norm_weight is None
               else norm_linear(x, norm_weight, args.rms_norm_eps, w_gate_up, quantized))
    if lora is None:
        return swiglu_linear(gate_up, w_down, unscaled)
    gate_up = lora.add(gate_up, x, "gate_up")
    hidden = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
    return lora.add(linear(hidden, w_down), hidden, "down")


def dense_mlp_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """As stored (the HF matrices); fuse_params makes w_gate_up."""
    h, i = args.hidden_size, args.intermediate_size
    return {"w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}


# mlp_kind -> (apply, per-layer weight shapes). An MoE block registers itself here.
MLPS: dict[str, tuple[Callable, Callable[[ModelArgs], dict]]] = {
    "dense": (dense_mlp, dense_mlp_shapes),
}
