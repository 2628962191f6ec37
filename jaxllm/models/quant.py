"""Quantised linear weights, and `linear(x, w)`: the one projection every layer calls.

A weight is a plain array [K, *out] (x [T, K] contracts its first axis) or one of:
  Fp8Weight  values [*out, K] float8_e4m3fn, scale [*out] float32: w[k, o] = values[o, k] * scale[o]
             (per output channel; K minor, the operand layout Hopper's FP8 GEMMs read). Up to
             GEMV_MAX_TOKENS tokens (decode), W8A16: x as it is times the weights widened in a
             GEMV kernel (pallas_kernels/fp8_gemv.py), the weight read being the whole cost.
             More tokens, W8A8: activations quantised per token on the fly, one FP8 x FP8 dot
             accumulating in fp32, then both scales. input_scale (a static-scheme checkpoint's,
             one per tensor): every token's activation scale instead of its own max.
  Fp8BlockWeight values [*out, K] float8_e4m3fn, scale [*out, G] float32, `group` rows of K a
             scale (block-wise checkpoints: a block's scale repeated over its rows of output
             channels): w[k, o] = values[o, k] * scale[o, k // group]. W8A8 with the activations
             quantised per token and group, in the block-scaled kernel
             (pallas_kernels/fp8_block_matmul.py), per device on a mesh (as int4).
  Fp8Experts values [E, K, N] float8_e4m3fn, scale [E, N] float32: an MoE layer's experts, each
             per output channel; W8A16 in the grouped matmul (a tile cast after its load, the
             accumulator scaled), the experts' own [E, K, N] layout kept.
  Int4Weight W4A16 (GPTQ/AWQ checkpoints, pallas_kernels/quant_matmul.py has the layout):
             qweight [K // 8, *out] int32, scales and zeros [K // group, *out], and `perm` [K]
             (GPTQ's act order: x's columns are gathered so each group's rows are contiguous).
             Up to GEMV_MAX_TOKENS tokens a CUDA-core GEMV (pallas_kernels/int4_gemv.py), past
             it the tensor-core kernel.
`map_out(fn, ws)` applies a layout change of the output axes (models/fused.py's concatenation
of q/k/v and stacking of gate/up) to plain and quantised weights alike.

Tensor parallelism: `shard_weight(w, sharding)` places a weight per the sharding of the plain
[K, *out] matrix it stands for (sharding/rules.py's rules): each array's output axes and K axis
as the plain weight's. FP8 runs on the global arrays (GSPMD partitions the dot, and the
per-token scale's max over a split K becomes a max all-reduce). Int4 runs the kernel per device
(shard_map, as attention), so a K split is built into its layout: K in `k_shards` equal slices,
each padded to the kernel's chunk and packed on its own, a slice per device.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.models.layer_stacks import in_place, value
from pallas_kernels import (fp8_block_matmul, fp8_gemv, fp8_quant, int4_gemv, quant_matmul,
                            silu_mul_fp8)
from pallas_kernels.quant_matmul import CHUNK_ROWS as INT4_CHUNK_ROWS, pack_int4  # noqa: F401 (loaders)

FP8, FP8_MAX, MIN_SCALE = fp8_quant.FP8, fp8_quant.FP8_MAX, fp8_quant.MIN_SCALE
BLOCK_MIN_GROUP = fp8_block_matmul.MIN_GROUP  # Fp8BlockWeight's smallest group (loaders)
SWIGLU_KERNEL_MIN_TOKENS = 512  # fp8_swiglu from here on: see fp8_swiglu_applies
# the GEMVs (W8A16, W4A16) up to here: one row; the runner gives engines with such weights a
# one-token bucket (worker/model_runner.py's token_buckets) for them
GEMV_MAX_TOKENS = 1


@jax.tree_util.register_dataclass
@dataclass
class Fp8Weight:
    values: jax.Array  # [*out, K] float8_e4m3fn
    scale: jax.Array  # [*out] float32 (a layer_stacks.Row in the step, None when stacked)
    input_scale: jax.Array | None = None  # [] float32: static activation scale (W8A8), or None
    STACKED_FIELDS: ClassVar[tuple[str, ...]] = ("scale", "input_scale")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [K, *out] shape, as the plain weight it stands for."""
        return (self.values.shape[-1], *self.values.shape[:-1])


@jax.tree_util.register_dataclass
@dataclass
class Fp8BlockWeight:
    values: jax.Array  # [*out, K] float8_e4m3fn
    scale: jax.Array  # [*out, cdiv(K, group)] float32
    group: int = field(default=128, metadata=dict(static=True))  # K rows a scale
    # the plain [K, *out] weight's PartitionSpec entries when placed on a mesh, else ()
    partition: tuple = field(default=(), metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.values.shape[-1], *self.values.shape[:-1])


@jax.tree_util.register_dataclass
@dataclass
class Fp8Experts:
    values: jax.Array  # [E, K, N] float8_e4m3fn
    scale: jax.Array  # [E, N] float32

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


@jax.tree_util.register_dataclass
@dataclass
class Int4Weight:
    qweight: jax.Array  # [Kp // 8, *out] int32, quant_matmul's packing, K zero-padded to Kp
    scales: jax.Array  # [Kp // group, *out] compute dtype (0 on the padding rows)
    zeros: jax.Array  # [Kp // group, *out] uint8
    perm: jax.Array | None = None  # [K] int32: x[:, perm] before the product (act order)
    in_features: int = field(default=0, metadata=dict(static=True))  # K
    # K's slices (rows of the permuted matrix), each padded to Kp / k_shards on its own
    k_shards: int = field(default=1, metadata=dict(static=True))
    # the plain [K, *out] weight's PartitionSpec entries when placed on a mesh, else ()
    partition: tuple = field(default=(), metadata=dict(static=True))

    STACKED_FIELDS: ClassVar[tuple[str, ...]] = ("scales", "zeros", "perm")

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.in_features, *self.qweight.shape[1:])


QUANTIZED = (Fp8Weight, Fp8BlockWeight, Fp8Experts, Int4Weight)


def rms_norm(x: jax.Array, weight, eps: float) -> jax.Array:
    """fp8_quant.rms_norm_reference (HF's RMSNorm), the weight an array or a layer_stacks.Row."""
    return fp8_quant.rms_norm_reference(x, value(weight), eps)


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED)


def linear(x: jax.Array, w, unscaled: bool = False):
    """x [T, K] @ w [K, *out] -> [T, *out] in x's dtype, for any weight kind above. unscaled:
    an FP8 W8A8 product on one device comes back as a ScaledProduct (the residual stream's
    projections, whose add the next norm's kernel takes)."""
    if isinstance(w, Fp8Weight):
        return _fp8_linear(x, w, unscaled)
    if isinstance(w, Int4Weight):
        return _int4_linear(x, w)
    if isinstance(w, Fp8BlockWeight):
        return _fp8_block_linear(x, w)
    return jnp.tensordot(x, w, axes=1)


def _fp8_linear(x: jax.Array, w: Fp8Weight, unscaled: bool = False):
    if fp8_gemv_applies(x):
        return _fp8_gemv(x, w)
    return _fp8_w8a8(x, w, unscaled=unscaled)


def _fp8_block_linear(x: jax.Array, w: Fp8BlockWeight) -> jax.Array:
    """x [T, K] @ w -> [T, *out]: on a mesh each device's rows and columns (shard_map, as int4:
    a K split holds whole groups, so x's group scales are the same), summed over a K split."""
    if not w.partition:
        return _fp8_block_local(x, w.values, w.scale, w.group)
    k_axis, out_axes = w.partition[0], w.partition[1:]

    def local(x, values, scale):
        y = _fp8_block_local(x, values, scale, w.group)
        return y if k_axis is None else jax.lax.psum(y, k_axis)

    spec = P(*out_axes, k_axis)
    return jax.shard_map(local, in_specs=(P(None, k_axis), spec, spec),
                         out_specs=P(None, *out_axes), check_vma=False)(x, w.values, w.scale)


def _fp8_block_local(x, values, scale, group: int) -> jax.Array:
    """x [T, K] quantised per token and group, times values [*out, K] and scale [*out, G] (the
    kernel on a GPU, its reference elsewhere) -> [T, *out] in x's dtype."""
    xq, x_scale = quantize_fp8_groups(x, group)
    flat_values = values.reshape(-1, values.shape[-1])
    flat_scale = scale.reshape(-1, scale.shape[-1])
    if jax.default_backend() == "gpu":
        y = fp8_block_matmul.fp8_block_matmul(xq, x_scale, flat_values, flat_scale, group=group,
                                              out_dtype=x.dtype)
    else:
        y = fp8_block_matmul.fp8_block_matmul_reference(xq, x_scale, flat_values, flat_scale,
                                                        group, x.dtype)
    return y.reshape(x.shape[0], *values.shape[:-1])


def _fp8_w8a8(x: jax.Array, w: Fp8Weight, norm_weight=None, eps: float = 0.0, *,
              quantized: tuple[jax.Array, jax.Array] | None = None, unscaled: bool = False):
    """x (RMS-normalised first, given norm_weight) quantised per token (or `quantized`, that
    already: residual_norm_quant's), one FP8 x FP8 dot, then both scales (or, unscaled, a
    ScaledProduct)."""
    xq, x_scale = quantized or quantize_activations(x, norm_weight, eps, w.input_scale)
    return _output(ScaledProduct(_fp8_dot(xq, w, x.dtype), x_scale, w.scale, x.dtype), unscaled)


@dataclass(frozen=True)
class ScaledProduct:
    """An FP8 W8A8 projection's output before its scales: the GEMM's product y [T, N], the
    tokens' scales [T, 1] and the weight's channel scales [N] (an array or a layer_stacks.Row).
    The residual stream's projections (o, down) leave it so: add_residual keeps it beside the
    stream, and residual_norm_quant adds it, normalises and quantises in one kernel
    (fp8_quant.fp8_quant_residual), where XLA's add was a kernel of its own."""
    y: jax.Array
    x_scale: jax.Array
    w_scale: object
    dtype: object

    def value(self) -> jax.Array:
        """The projection's output [T, N] in its dtype."""
        return _fp8_scaled(self.y, self.x_scale, value(self.w_scale), self.dtype)


@dataclass(frozen=True)
class ResidualSum:
    """The residual stream as residual + product, not yet added."""
    residual: jax.Array
    product: ScaledProduct

    def value(self) -> jax.Array:
        return self.residual + self.product.value()


def _output(product: ScaledProduct, unscaled: bool):
    """The product as it is where asked and residual_norm_quant's kernel can take it (on one
    device), else scaled."""
    return product if unscaled and on_one_device() else product.value()


def add_residual(residual: jax.Array, out):
    """residual + out (an array or a ScaledProduct, whose add waits for residual_norm_quant)."""
    return ResidualSum(residual, out) if isinstance(out, ScaledProduct) else residual + out


def materialize(x) -> jax.Array:
    """The residual stream as an array (a ResidualSum added by XLA)."""
    return x.value() if isinstance(x, ResidualSum) else x


def residual_norm_quant(x, norm_weight, eps: float, w):
    """x, the residual stream (an array or a ResidualSum), before the norm (norm_weight) and
    projection w it feeds -> (x as an array, and the normalised x quantised per token as the
    W8A8 GEMM takes it, or None where w is not that). A ResidualSum's add, norm and
    quantisation are one kernel on one GPU; jnp elsewhere (the same roundings as
    materialize's add, then quantize_activations)."""
    if not isinstance(x, ResidualSum):
        return x, None
    if not (isinstance(w, Fp8Weight) and norm_weight.dtype == x.residual.dtype):
        return x.value(), None
    product = x.product
    if jax.default_backend() == "gpu":
        (scale, scale_layer), (norm, norm_layer) = in_place(product.w_scale), in_place(norm_weight)
        static, static_layer = in_place(w.input_scale)
        h, xq, x_scale = fp8_quant.fp8_quant_residual(
            product.y, product.x_scale[:, 0], scale, x.residual, norm, static_scale=static,
            eps=eps, scale_layer=scale_layer, norm_layer=norm_layer, static_layer=static_layer)
        return h, (xq, x_scale[:, None])
    h = x.value()
    return h, quantize_fp8_rows(rms_norm(h, norm_weight, eps), value(w.input_scale))


def quantize_activations(x: jax.Array, norm_weight=None, eps: float = 0.0,
                         input_scale=None) -> tuple[jax.Array, jax.Array]:
    """x [T, K] (RMS-normalised first, given norm_weight: an array or a layer_stacks.Row) ->
    (float8_e4m3fn [T, K], fp32 scale [T, 1]) per token (every token at input_scale, given
    that: a static scale, an array or a Row): one kernel on one GPU
    (pallas_kernels/fp8_quant.py, where XLA makes two or three), jnp elsewhere."""
    if jax.default_backend() == "gpu" and on_one_device() and (
            norm_weight is None or norm_weight.dtype == x.dtype):
        (norm, layer), (static, static_layer) = in_place(norm_weight), in_place(input_scale)
        xq, scale = fp8_quant.fp8_quant(x, norm, static_scale=static, eps=eps, layer=layer,
                                        static_layer=static_layer)
        return xq, scale[:, None]
    return quantize_fp8_rows(x if norm_weight is None else rms_norm(x, norm_weight, eps),
                             value(input_scale))


def fp8_gemv_applies(x: jax.Array) -> bool:
    """Whether an FP8 projection of x runs as the W8A16 GEMV: up to GEMV_MAX_TOKENS tokens
    (there the weight read is the whole cost, and cuBLAS's FP8 GEMM falls short of it, besides
    the activations' quantisation), on one device (the kernel sees w's output axes as one)."""
    return x.shape[0] <= GEMV_MAX_TOKENS and on_one_device()


def has_gemv_weights(params) -> bool:
    """Whether any projection in params is an Fp8Weight or Int4Weight (the GEMVs' kinds)."""
    kinds = (Fp8Weight, Int4Weight)
    leaves = jax.tree.leaves(params, is_leaf=lambda leaf: isinstance(leaf, kinds))
    return any(isinstance(leaf, kinds) for leaf in leaves)


@dataclass(frozen=True)
class SplitProduct:
    """An FP8 GEMV's output before the end of its K split (fp8_gemv.Splits: the splits' fp32
    products and, with the input norm, their sums of x^2), for a consumer kernel that finishes
    it as it reads (the rope and KV write, models/attention.py), where the end was a kernel of
    its own; k, eps: the GEMV's K and norm epsilon, out_shape: w's output axes."""
    splits: fp8_gemv.Splits
    k: int
    eps: float
    dtype: object
    out_shape: tuple

    def value(self) -> jax.Array:
        """The projection's output [T, *out] in its dtype, as the GEMV's wrapper ends it."""
        y = fp8_gemv.finish_splits(self.splits, self.k, self.eps, self.dtype)
        return y.reshape(y.shape[0], *self.out_shape)


def _fp8_gemv(x: jax.Array, w: Fp8Weight, norm_weight=None, eps: float = 0.0,
              swiglu: bool = False, keep_splits: bool = False):
    """x [T, K] @ w -> [T, *out] by the GEMV kernel (its reference off the GPU), w's output
    axes flattened (free on one device); given norm_weight, x RMS-normalised first, in the
    kernel; with swiglu x is [T, 2K], gate then up, and the operand silu(gate) * up. A stacked
    scale or norm weight (layer_stacks.Row) is read in place. keep_splits: a K-split GEMV's
    output may come back as a SplitProduct."""
    out_shape = w.values.shape[:-1]
    values = w.values.reshape(-1, w.values.shape[-1])
    if jax.default_backend() != "gpu":
        y = fp8_gemv.fp8_gemv_reference(x, values, value(w.scale).reshape(-1),
                                        value(norm_weight), eps, swiglu)
        return y.reshape(x.shape[0], *out_shape)
    (scale, scale_layer), (norm, norm_layer) = in_place(w.scale), in_place(norm_weight)
    layer = _one_layer(scale_layer, norm_layer)
    scale = scale.reshape(*scale.shape[:scale.ndim - len(out_shape)], -1)  # [(L,) N]
    y = fp8_gemv.fp8_gemv(x, values, scale, norm, eps=eps, layer=layer, swiglu=swiglu,
                          keep_splits=keep_splits)
    if isinstance(y, fp8_gemv.Splits):
        return SplitProduct(y, values.shape[1], eps, x.dtype, out_shape)
    return y.reshape(x.shape[0], *out_shape)


def _one_layer(*layers: int | None) -> int | None:
    """The layer of a kernel's stacked operands (all one layer's, by construction)."""
    found = {layer for layer in layers if layer is not None}
    if len(found) > 1:
        raise ValueError(f"operands of one call from different layers: {sorted(found)}")
    return found.pop() if found else None


def norm_linear(x: jax.Array, norm_weight, eps: float, w,
                quantized: tuple[jax.Array, jax.Array] | None = None, unscaled: bool = False):
    """linear(rms_norm(x, norm_weight, eps), w) (norm_weight an array or a layer_stacks.Row):
    where the FP8 GEMV runs, the norm runs inside it (one kernel, not three: the norm's
    reduction and scaling, then the GEMV); an FP8 weight's W8A8 takes it into its activations'
    quantisation. Other one-token steps apply the RMS (a scalar a token) to the product, not to
    x: XLA then makes the sum of squares and x times the norm's weight one fusion, where the
    reduction and the scaling of x were a launch-bound kernel each, and folds the RMS into the
    product's consumers. quantized: x's norm already quantised (residual_norm_quant's);
    unscaled: an FP8 product may come back unfinished, a ScaledProduct (W8A8) or a
    SplitProduct (the GEMV), for its consumer's kernel to finish."""
    if isinstance(w, Fp8Weight) and fp8_gemv_applies(x):
        if norm_weight.dtype == x.dtype:
            return _fp8_gemv(x, w, norm_weight, eps, keep_splits=unscaled)
    elif isinstance(w, Fp8Weight):
        return _fp8_w8a8(x, w, norm_weight, eps, quantized=quantized, unscaled=unscaled)
    if x.shape[0] > GEMV_MAX_TOKENS:
        return linear(rms_norm(x, norm_weight, eps), w)
    x32 = x.astype(jnp.float32)
    weighted = (x32 * value(norm_weight).astype(jnp.float32)).astype(x.dtype)
    y = linear(weighted, w)
    rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + eps)  # [T]
    return (y.astype(jnp.float32) * rms.reshape(-1, *([1] * (y.ndim - 1)))).astype(y.dtype)


def swiglu_linear(gate_up: jax.Array, w, unscaled: bool = False):
    """linear(silu(gate) * up, w, unscaled) of gate_up [T, 2, I]: where the FP8 GEMV runs,
    SwiGLU runs inside it (one kernel, not two: the GEMV reads gate and up as its x; a few
    instructions a tile there, where the int4 GEMV's per-thread x work would nearly double its
    loop)."""
    if isinstance(w, Fp8Weight) and fp8_gemv_applies(gate_up):
        return _fp8_gemv(gate_up.reshape(gate_up.shape[0], -1), w, swiglu=True)
    return linear(jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1], w, unscaled)


def _fp8_dot(xq: jax.Array, w: Fp8Weight, dtype) -> jax.Array:
    """xq [T, K] float8 @ w -> [T, *out], unscaled, for a model of `dtype`. The GEMM
    accumulates in fp32 and writes bf16 for a bf16 model: an fp32 product would be written and
    read back only to be scaled, the scales being per token and channel (cuBLASLt folds only
    per-tensor ones); XLA may still widen a GEMM's output into its scaling. Other models get
    fp32: unscaled products of float8 values (up to 448 each) overflow float16. w's output axes
    are kept (no reshape to [N, K]): a reshape would merge a split output axis (w_gate_up's I)
    with an unsplit one, which GSPMD can only do by gathering."""
    out_ndim = w.values.ndim - 1
    product = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    return jax.lax.dot_general(xq, w.values, (((1,), (out_ndim,)), ((), ())),
                               preferred_element_type=product)  # [T, *out]


def _fp8_scaled(y: jax.Array, x_scale: jax.Array, w_scale: jax.Array, dtype) -> jax.Array:
    """_fp8_dot's product [T, *out] times the token scales x_scale [T, 1] and channel scales
    w_scale [*out], in fp32, to dtype."""
    x_scale = x_scale.reshape(-1, *([1] * (y.ndim - 1)))
    return (y.astype(jnp.float32) * x_scale * w_scale).astype(dtype)


def fp8_swiglu_applies(x: jax.Array, w_gate_up, w_down) -> bool:
    """Whether fp8_swiglu serves this MLP: both projections FP8, on one device (the kernel would
    need the token max over a split I), from SWIGLU_KERNEL_MIN_TOKENS tokens (with fewer, XLA's
    two passes measured faster: the kernel's one program per token walks its row alone,
    leaving most of the GPU idle)."""
    return (isinstance(w_gate_up, Fp8Weight) and isinstance(w_down, Fp8Weight)
            and x.shape[0] >= SWIGLU_KERNEL_MIN_TOKENS and on_one_device())


def fp8_swiglu(x: jax.Array, w_gate_up: Fp8Weight, w_down: Fp8Weight, norm_weight=None,
               eps: float = 0.0, *, quantized: tuple[jax.Array, jax.Array] | None = None,
               unscaled: bool = False):
    """down(silu(gate(x)) * up(x)) with both GEMMs FP8 (x RMS-normalised first, given
    norm_weight); w_gate_up [H, 2, I], w_down [I, H]; x [T, H] -> [T, H]. The down
    projection's operand (silu(gate) * up quantised per token) comes from one kernel reading
    the gate/up GEMM's unscaled product (pallas_kernels/silu_mul_fp8.py), where XLA spends two
    passes over it. quantized: x's norm already quantised (residual_norm_quant's); unscaled:
    the down projection's output as a ScaledProduct."""
    xq, x_scale = quantized or quantize_activations(x, norm_weight, eps, w_gate_up.input_scale)
    y = _fp8_dot(xq, w_gate_up, x.dtype)  # [T, 2, I]
    if jax.default_backend() == "gpu":
        (w_scale, layer), (static, static_layer) = (in_place(w_gate_up.scale),
                                                    in_place(w_down.input_scale))
        hq, h_scale = silu_mul_fp8.silu_mul_fp8(
            y.reshape(y.shape[0], -1), x_scale[:, 0],
            w_scale.reshape(*w_scale.shape[:w_scale.ndim - 2], -1), static_scale=static,
            layer=layer, static_layer=static_layer)
    else:
        hq, h_scale = silu_mul_fp8.silu_mul_fp8_reference(
            y.reshape(y.shape[0], -1), x_scale[:, 0], value(w_gate_up.scale).reshape(-1),
            value(w_down.input_scale))
    return _output(ScaledProduct(_fp8_dot(hq, w_down, x.dtype), h_scale[:, None], w_down.scale,
                                 x.dtype), unscaled)


def on_one_device() -> bool:
    """Whether the traced step runs on one device (no mesh, or a mesh of one): a kernel then
    needs no shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def _int4_linear(x: jax.Array, w: Int4Weight) -> jax.Array:
    if not w.partition:
        return _int4_local(x, w.qweight, w.scales, w.zeros, w.perm)
    # placed on a mesh: never stacked (layer_stacks is for one device)
    k_axis, out_axes = w.partition[0], w.partition[1:]
    rows = P(*w.partition)
    perm = () if w.perm is None else (w.perm,)

    def local(x, qweight, scales, zeros, *perm):
        if perm and k_axis is not None:
            # act order over a K split: a device's packed rows come from anywhere in K, so it
            # gathers x whole (an all-gather of the activations; without act order x stays split)
            x = jax.lax.all_gather(x, k_axis, axis=1, tiled=True)
        y = _int4_local(x, qweight, scales, zeros, *perm)
        return y if k_axis is None else jax.lax.psum(y, k_axis)

    return jax.shard_map(local, in_specs=(P(None, k_axis), rows, rows, rows) +
                         (P(k_axis),) * len(perm), out_specs=P(None, *out_axes),
                         check_vma=False)(x, w.qweight, w.scales, w.zeros, *perm)


def _int4_local(x, qweight, scales, zeros, perm=None) -> jax.Array:
    """One device's product: its rows of the packed matrix (K padded to qweight's rows);
    scales, zeros and perm arrays or layer_stacks.Rows (the kernels read those in place)."""
    if perm is not None:
        x = x[:, value(perm)]
    x = jnp.pad(x, ((0, 0), (0, 8 * qweight.shape[0] - x.shape[1])))
    flat = lambda a: a.reshape(*a.shape[:a.ndim + 1 - qweight.ndim], -1)  # [(L,) rows, N]
    if jax.default_backend() != "gpu":
        y = quant_matmul.int4_matmul_reference(x, flat(qweight), flat(value(scales)),
                                               flat(value(zeros)))
        return y.reshape(x.shape[0], *qweight.shape[1:])
    matmul = int4_gemv.int4_gemv if x.shape[0] <= GEMV_MAX_TOKENS else quant_matmul.int4_matmul
    (scales, layer), (zeros, zeros_layer) = in_place(scales), in_place(zeros)
    y = matmul(x, flat(qweight), flat(scales), flat(zeros),
               layer=_one_layer(layer, zeros_layer))
    return y.reshape(x.shape[0], *qweight.shape[1:])


def _to_fp8(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """x -> (float8_e4m3fn values, fp32 scale kept as a size-1 `axis`): the scale is the absolute
    max over `axis` / 448, and x ~ values * scale."""
    x32 = x.astype(jnp.float32)
    scale = fp8_quant.row_scales(jnp.max(jnp.abs(x32), axis=axis, keepdims=True))
    return jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def quantize_fp8_rows(x: jax.Array, static_scale=None) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (float8_e4m3fn [T, K], fp32 scale [T, 1]): x ~ values * scale, per token
    (every token at static_scale [], given that; saturated)."""
    x32 = x.astype(jnp.float32)
    scale = fp8_quant.token_scales(x32, static_scale)  # [T]
    return fp8_quant.to_fp8(x32, scale), scale[:, None]


def quantize_fp8_groups(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (float8_e4m3fn [T, K], fp32 scale [T, cdiv(K, group)]) per token and group of
    K (the last group may be partial): x ~ values * scale[:, k // group]."""
    t, k = x.shape
    groups = -(-k // group)
    padded = jnp.pad(x, ((0, 0), (0, groups * group - k))).reshape(t, groups, group)
    values, scale = _to_fp8(padded, -1)  # [T, G, group], [T, G, 1]
    return values.reshape(t, -1)[:, :k], scale[..., 0]


@jax.jit
def quantize_fp8(w: jax.Array) -> Fp8Weight:
    """w [K, *out] -> Fp8Weight with one scale per output channel (its absolute max / 448)."""
    k, out_shape = w.shape[0], w.shape[1:]
    values, scale = _to_fp8(w.reshape(k, -1), 0)  # [K, N], [1, N]
    return Fp8Weight(values.T.reshape(*out_shape, k), scale.reshape(out_shape))


@jax.jit
def quantize_fp8_experts(w: jax.Array) -> Fp8Experts:
    """w [E, K, N] -> Fp8Experts with one scale per (expert, output channel)."""
    values, scale = _to_fp8(w, 1)  # [E, K, N], [E, 1, N]
    return Fp8Experts(values, scale[:, 0])


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    """The plain matrix a weight stands for ([K, *out]; experts [E, K, N]) (tests, references)."""
    if isinstance(w, Fp8Experts):
        return (w.values.astype(jnp.float32) * w.scale[:, None, :]).astype(dtype)
    if isinstance(w, Fp8Weight):
        values = jnp.moveaxis(w.values, -1, 0).astype(jnp.float32)
        return (values * value(w.scale)).astype(dtype)
    if isinstance(w, Fp8BlockWeight):
        scale = fp8_block_matmul.group_scales(w.scale, w.group, w.values.shape[-1])
        return jnp.moveaxis(w.values.astype(jnp.float32) * scale, -1, 0).astype(dtype)
    if isinstance(w, Int4Weight):
        flat = lambda a: a.reshape(a.shape[0], -1)
        dense = quant_matmul.dequantize_int4(flat(w.qweight), flat(value(w.scales)),
                                             flat(value(w.zeros)))
        slices = dense.reshape(w.k_shards, -1, dense.shape[1])  # each slice's padding dropped
        dense = slices[:, :w.in_features // w.k_shards].reshape(w.in_features, -1)
        if w.perm is not None:  # row i of the packed matrix is input row perm[i]
            dense = jnp.zeros_like(dense).at[value(w.perm)].set(dense)
        return dense.reshape(w.shape).astype(dtype)
    return w.astype(dtype)


def map_out(fn: Callable[..., jax.Array], ws: list):
    """fn(*arrays) over the output axes of several weights of one kind (each array's leading
    axes are kept as they are, its last is an output axis): plain arrays, or the arrays of
    quantised weights that carry output axes; a weight's `perm` must be shared and is kept."""
    first = ws[0]
    if isinstance(first, Fp8Weight):
        values = fn(*(jnp.moveaxis(w.values, -1, 0) for w in ws))
        return Fp8Weight(jnp.moveaxis(values, 0, -1), fn(*(w.scale for w in ws)),
                         _shared_input_scale(ws))
    if isinstance(first, Fp8BlockWeight):
        moved = lambda arrays: (jnp.moveaxis(a, -1, 0) for a in arrays)  # K (or G) first
        return Fp8BlockWeight(jnp.moveaxis(fn(*moved(w.values for w in ws)), 0, -1),
                              jnp.moveaxis(fn(*moved(w.scale for w in ws)), 0, -1), first.group)
    if isinstance(first, Int4Weight):  # a new layout: placed again by shard_weight
        return dataclasses.replace(first, qweight=fn(*(w.qweight for w in ws)),
                                   scales=fn(*(w.scales for w in ws)),
                                   zeros=fn(*(w.zeros for w in ws)), partition=())
    return fn(*ws)


def _shared_input_scale(ws: list[Fp8Weight]):
    """The static input scale of weights fused into one GEMM (which reads one x): the largest
    of theirs, as vLLM's fused q/k/v and gate/up take; None where they have none."""
    scales = [w.input_scale for w in ws]
    if all(scale is None for scale in scales):
        return None
    if any(scale is None for scale in scales):
        raise ValueError("FP8 weights fused into one GEMM mix static and dynamic activation "
                         "scales.")
    return jnp.max(jnp.stack(scales))


def k_shards_of(sharding: NamedSharding | None) -> int:
    """How many slices a plain weight's sharding splits its K (first) axis into."""
    spec = () if sharding is None else tuple(sharding.spec)
    if not spec or spec[0] is None:
        return 1
    names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return math.prod(sharding.mesh.shape[name] for name in names)


def block_split_fits(k: int, group: int, sharding: NamedSharding | None) -> bool:
    """Whether a block-scaled weight's K (groups of `group` rows) splits into whole groups per
    device under the plain matrix's sharding."""
    shards = k_shards_of(sharding)
    return shards == 1 or k % (shards * group) == 0


def shard_weight(w, sharding: NamedSharding | None):
    """Places a weight (its arrays on host or device) per the sharding of the plain [K, *out]
    matrix it stands for; None: the default device."""
    if sharding is None:
        return jax.device_put(w)
    if not is_quantized(w):
        return jax.device_put(w, sharding)
    spec = tuple(sharding.spec) + (None,) * (len(w.shape) - len(sharding.spec))
    k_axis, out_axes = spec[0], spec[1:]
    put = lambda a, *s: jax.device_put(a, NamedSharding(sharding.mesh, P(*s)))
    if isinstance(w, Fp8BlockWeight):  # the scale's groups split as K is
        if not block_split_fits(w.shape[0], w.group, sharding):
            raise ValueError(f"A block-scaled FP8 weight (K={w.shape[0]}, groups of {w.group}) "
                             f"cannot be split {k_shards_of(sharding)} ways along K "
                             f"({sharding.spec}): a device's K must hold whole groups.")
        return Fp8BlockWeight(put(w.values, *out_axes, k_axis), put(w.scale, *out_axes, k_axis),
                              w.group, spec if any(a is not None for a in spec) else ())
    if isinstance(w, Fp8Weight):  # the scale is per output channel: replicated over a K split
        input_scale = None if w.input_scale is None else put(w.input_scale)
        return Fp8Weight(put(w.values, *out_axes, k_axis), put(w.scale, *out_axes), input_scale)
    if isinstance(w, Fp8Experts):  # [E, K, N]: the scale [E, N] split as E and N are
        return Fp8Experts(put(w.values, *spec), put(w.scale, spec[0], spec[2]))
    if w.k_shards != k_shards_of(sharding):
        raise ValueError(f"An int4 weight packed in {w.k_shards} K slices cannot be placed "
                         f"with K split {k_shards_of(sharding)} ways ({sharding.spec}).")
    perm = None if w.perm is None else put(w.perm, k_axis)
    return dataclasses.replace(w, qweight=put(w.qweight, *spec), scales=put(w.scales, *spec),
                               zeros=put(w.zeros, *spec), perm=perm,
                               partition=spec if any(a is not None for a in spec) else ())


# The projections quantised: attention, the dense MLP, Qwen2-MoE's shared expert, and MoE
# experts (EXPERT_NAMES, their own layout). Embedding, LM head and router keep the model dtype
# (vLLM also leaves the LM head unquantised).
QUANTIZED_NAMES = ("wqkv", "wo", "w_gate_up", "w_down", "shared_gate", "shared_up",
                   "shared_down")
EXPERT_NAMES = ("experts_gate", "experts_up", "experts_down")


def quantize_params_fp8(params: dict, sharding_of: Callable | None = None,
                        input_scale: float | None = None) -> dict:
    """Compute-layout params -> FP8 projections, layer by layer; each 16-bit matrix is freed
    once quantised, so the peak is the 16-bit model plus one layer. sharding_of(path, shape):
    where each plain matrix lives on a mesh (None: one device); input_scale: every dense
    projection's static activation scale (dummy weights for a static checkpoint), else
    dynamic."""
    layers = []
    for index, layer in enumerate(params["layers"]):
        quantized = dict(layer)
        for name in QUANTIZED_NAMES + EXPERT_NAMES:
            if name in layer and not is_quantized(layer[name]):
                plain = layer[name]
                sharding = None if sharding_of is None else sharding_of(
                    f"layers.{index}.{name}", plain.shape)
                if name in EXPERT_NAMES:
                    weight = quantize_fp8_experts(plain)
                else:
                    weight = quantize_fp8(plain)
                    if input_scale is not None:
                        weight.input_scale = jnp.float32(input_scale)
                quantized[name] = shard_weight(weight, sharding)
                plain.delete()
        layers.append(quantized)
    return {**params, "layers": layers}
