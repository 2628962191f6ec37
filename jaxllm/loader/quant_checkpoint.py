"""Quantised checkpoints: which a model can run, and their linears read into models/quant.py's
weights (integer repacking on the host; nothing is dequantised to 16 bits).

Formats, as their writers define them (HF weights are [out, in] = [N, K]):
  fp8 (vLLM) / compressed-tensors float8 / modelopt (NVIDIA's ModelOpt: `quant_algo` FP8 =
      per-tensor weight and static activation scales, FP8_PER_CHANNEL_PER_TOKEN = per-channel
      weights and dynamic activations, FP8_PB_WO = 128 x 128 blocks, its scales stored
      [N / 128, 1, K / 128, 1]; KV scales as `k_proj.k_scale` / `v_proj.v_scale`):
      `weight` float8_e4m3fn [N, K], `weight_scale` one
      value per tensor ([] or [1]) or per output channel ([N] or [N, 1]); `input_scale` ([] or
      [1]), the static activation scale of fp8's `activation_scheme: static` (compressed-tensors:
      `input_activations` not dynamic, per tensor), which the W8A8 GEMMs quantise their inputs
      at (fused linears take the largest); with dynamic activations it is not read. An MoE's
      experts are linears of their own (`experts.{e}.gate_proj` ...), stacked after reading.
      Block-wise (fp8's `weight_block_size` [bn, bk] with `weight_scale_inv`, compressed-tensors'
      `block` strategy with `weight_scale`): scales [cdiv(N, bn), cdiv(K, bk)], w = values times
      its block's scale. Kept as they are (Fp8BlockWeight: the block-scaled kernel); MoE
      experts, blocks of fewer than 32 K rows and K splits off block boundaries are
      requantised per output channel (one more float8 rounding: docs/quantization.md).
  gptq: `qweight` [K / 8, N] int32, nibble i of word r = row 8r + i; `qzeros` [K / g, N / 8]
      int32, nibble i of word c = column 8c + i, stored minus one (GPTQ's v1 format);
      `scales` [K / g, N]; `g_idx` [K]: the group of each input row (act order permutes it).
  awq (GEMM): `qweight` [K, N / 8] and `qzeros` [K / g, N / 8] int32 packed along N in the order
      0 2 4 6 1 3 5 7 (nibble i = column 8c + _AWQ_ORDER[i]); `scales` [K / g, N]. No offset.
  w[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n].
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxllm.models import ModelArgs
from jaxllm.loader.hf_names import map_hf_name, split_expert_path
from jaxllm.models.quant import (BLOCK_MIN_GROUP, INT4_CHUNK_ROWS, Fp8BlockWeight, Fp8Experts,
                                 Fp8Weight, Int4Weight, block_split_fits, k_shards_of, pack_int4,
                                 quantize_fp8, shard_weight)

logger = logging.getLogger(__name__)

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_scale", "weight_scale_inv",
             "input_scale", "weight")
_GPTQ_GROUPS = (32, 64, 128)


def check_supported(method: str | None, hf_config: dict, args: ModelArgs,
                    tensor_parallel_size: int) -> None:
    """Refuses, before loading, a method this model or jaxllm cannot run, with the reason."""
    if method is None:
        return
    qconfig = hf_config.get("quantization_config") or {}
    if method in ("gptq", "awq"):
        _check_int4(method, qconfig, args)
        _check_int4_row_split(method, qconfig, args, tensor_parallel_size)
    elif method == "compressed-tensors":
        _check_compressed_tensors(qconfig)
    elif method == "modelopt":
        _check_modelopt(qconfig)
    if method == "fp8":
        _check_fp8_blocks(qconfig)


def _check_fp8_blocks(qconfig: dict) -> None:
    scheme = qconfig.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"Unsupported activation scheme {scheme}")
    block = qconfig.get("weight_block_size")
    if block is not None and scheme == "static":
        raise ValueError("The block-wise quantization only supports dynamic activation scheme "
                         "for now, but got static activation scheme.")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"weight_block_size {block} is not supported: jaxllm reads 2-D blocks "
                         "[block_n, block_k].")
    if str(qconfig.get("scale_fmt") or "float") != "float":
        raise ValueError(f"fp8 checkpoints with scale_fmt {qconfig['scale_fmt']!r} are not "
                         "supported: jaxllm reads float32 block scales.")


# Hopper/Ada for FP8 (tensor cores and Triton's float8 casts); the int4 kernel needs Ampere
_MIN_CAPABILITY = {"fp8": 89, "compressed-tensors": 89, "modelopt": 89, "gptq": 80, "awq": 80}
# ModelOpt's FP8 algorithms (those jaxllm runs), and the rest of vLLM's list
_MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")
_MODELOPT_OTHER = ("NVFP4", "W4A16_NVFP4", "MXFP8", "MIXED_PRECISION")
FP8_METHODS = ("fp8", "compressed-tensors", "modelopt")  # checkpoints of float8 linears


def check_device(method: str | None, kv_cache_dtype: str) -> None:
    """vLLM's refusal of a method the GPU cannot run (a CPU runs every method, slowly)."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return
    current = int(str(capability).replace(".", ""))
    for name, what in ((method, "quantization method"),
                       ("fp8" if kv_cache_dtype != "auto" else None, "kv_cache_dtype")):
        if name is not None and current < _MIN_CAPABILITY[name]:
            raise ValueError(f"The {what} {name} is not supported for the current GPU. Minimum "
                             f"capability: {_MIN_CAPABILITY[name]}. Current capability: "
                             f"{current}.")


def _check_int4(method: str, qconfig: dict, args: ModelArgs) -> None:
    bits = qconfig.get("bits", qconfig.get("w_bit"))
    group = qconfig.get("group_size", qconfig.get("q_group_size"))
    if bits != 4:
        raise ValueError(f"{method} with {bits}-bit weights is not supported: jaxllm runs "
                         "4-bit GPTQ/AWQ checkpoints.")
    if group not in _GPTQ_GROUPS:
        raise ValueError(f"{method} with group_size {group} is not supported; supported: "
                         f"{list(_GPTQ_GROUPS)}.")
    if method == "awq" and str(qconfig.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {qconfig.get('version')!r} is not supported; only the "
                         "GEMM layout.")
    if method == "awq" and not qconfig.get("zero_point", True):
        raise ValueError("AWQ without zero points is not supported.")
    if args.num_experts:
        raise ValueError(f"{method} is not supported for MoE models ({args.architecture}) in "
                         "jaxllm; it runs 4-bit Llama/Qwen/Mistral dense checkpoints.")


def _check_int4_row_split(method: str, qconfig: dict, args: ModelArgs, tp: int) -> None:
    """TP splits o_proj's and down_proj's input rows: each device's rows must be whole groups
    (they share scales and zero points)."""
    group = qconfig.get("group_size", qconfig.get("q_group_size"))
    for name, k in (("o_proj", args.q_size), ("down_proj", args.intermediate_size)):
        if k % tp or (k // tp) % group:
            raise ValueError(f"The input size is not aligned with the quantized weight shape. "
                             f"This can be caused by too large tensor parallel size. ({method}: "
                             f"{name}'s input size {k} split over tensor_parallel_size={tp} "
                             f"gives {k / tp:g} rows per device, not a multiple of group_size "
                             f"{group}.)")


def modelopt_algo(qconfig: dict) -> str:
    """A ModelOpt quantization_config's quant_algo, upper-cased ('' where it has none)."""
    return str(qconfig.get("quant_algo") or "").upper()


def _check_modelopt(qconfig: dict) -> None:
    algo = modelopt_algo(qconfig)
    if not algo:
        raise ValueError("Missing 'quant_algo' in quantization config")
    if algo in _MODELOPT_OTHER:
        raise ValueError(f"ModelOpt quant_algo {algo} is not supported: jaxllm runs ModelOpt's "
                         f"FP8 checkpoints ({', '.join(_MODELOPT_FP8)}).")
    if algo not in _MODELOPT_FP8:
        known = list(_MODELOPT_FP8 + _MODELOPT_OTHER)
        raise ValueError(f"ModelOpt currently only supports: {known} quantizations in vLLM. "
                         "Please check the `hf_quant_config.json` file for your model's quant "
                         "configuration.")
    kv = qconfig.get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() != "FP8":
        raise ValueError(f"ModelOpt kv_cache_quant_algo {kv} is not supported: jaxllm reads "
                         "static FP8 KV cache scales.")


def _check_compressed_tensors(qconfig: dict) -> None:
    for name, group in (qconfig.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or \
                weights.get("strategy") not in ("tensor", "channel", "block") or \
                (weights.get("strategy") == "block" and (not block or len(block) != 2)):
            raise ValueError(f"compressed-tensors scheme {name} ({weights}) is not supported: "
                             "jaxllm reads float8 weights with per-tensor, per-channel or 2-D "
                             "block-wise scales.")
        inputs = group.get("input_activations") or {}
        if inputs and not inputs.get("dynamic", True) and (
                inputs.get("strategy") != "tensor" or weights.get("strategy") == "block"):
            raise ValueError(f"compressed-tensors scheme {name} (input_activations {inputs}) is "
                             "not supported: jaxllm reads static activation scales one per "
                             "tensor, beside per-tensor or per-channel weight scales.")
    kv = qconfig.get("kv_cache_scheme")
    if kv and ((kv.get("type"), kv.get("num_bits"), kv.get("strategy")) != ("float", 8, "tensor")
               or kv.get("dynamic")):
        raise ValueError(f"compressed-tensors kv_cache_scheme {kv} is not supported: jaxllm "
                         "reads static float8 KV cache scales, one per tensor.")


def check_dummy(method: str | None, hf_config: dict) -> None:
    """load_format='dummy' on a quantised checkpoint's config: random FP8 weights (per-channel
    scales; static activation scales of 1 where its scheme is static) stand in for an FP8 one
    (FP8_METHODS, not block-wise); other methods' dummy weights are not built (they would run
    16-bit, unlike the checkpoint)."""
    qconfig = hf_config.get("quantization_config") or {}
    fp8 = method in FP8_METHODS
    if not qconfig or fp8 and fp8_block_size(qconfig) is None:
        return
    raise ValueError(f"load_format='dummy' is not supported for {method} checkpoints"
                     f"{' with block-wise scales' if fp8 else ''}: jaxllm builds dummy weights "
                     "for fp8, compressed-tensors float8 and ModelOpt FP8 checkpoints with "
                     "per-tensor or per-channel scales.")


def static_activations(qconfig: dict) -> bool:
    """Whether an FP8 checkpoint's activation scales are static (its linears' `input_scale`)."""
    if qconfig.get("quant_method") == "fp8":
        return qconfig.get("activation_scheme", "dynamic") == "static"
    if qconfig.get("quant_method") == "modelopt":
        return modelopt_algo(qconfig) == "FP8"
    return any(not (group.get("input_activations") or {}).get("dynamic", True)
               for group in (qconfig.get("config_groups") or {}).values())


def build_weight(method: str, tensors: dict[str, np.ndarray], qconfig: dict, dtype,
                 sharding: NamedSharding | None = None):
    """One linear's checkpoint tensors -> its quantised weight, in the [K, *out] storage layout
    the loader and fuse_params use (before fusion), placed per `sharding` (the plain matrix's:
    models/quant.shard_weight; None: the default device)."""
    if "weight" in tensors:
        block = fp8_block_size(qconfig)
        keep = keeps_blocks(block, tensors["weight"].shape[1], sharding)
        weight = _fp8_weight(tensors, block, keep_blocks=keep,
                             static=static_activations(qconfig))
        return shard_weight(weight, sharding)
    if method == "gptq":
        q, zeros, scales, g_idx = unpack_gptq(tensors, qconfig)
    else:
        q, zeros, scales = unpack_awq(tensors)
        g_idx = None
    return shard_weight(int4_weight(q, zeros, scales, g_idx, dtype, k_shards_of(sharding)),
                        sharding)


def fp8_block_size(qconfig: dict) -> tuple[int, int] | None:
    """[block_n, block_k] of a block-wise FP8 checkpoint's scales, else None."""
    if qconfig.get("weight_block_size"):
        return tuple(qconfig["weight_block_size"])
    if qconfig.get("quant_method") == "modelopt" and modelopt_algo(qconfig) == "FP8_PB_WO":
        return (128, 128)
    for group in (qconfig.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("strategy") == "block":
            return tuple(weights["block_structure"])
    return None


def keeps_blocks(block: tuple[int, int] | None, k: int, sharding: NamedSharding | None) -> bool:
    """Whether a dense linear of K inputs with these block scales runs block-scaled: blocks the
    kernel takes, and whole blocks on each device of a K split."""
    return (block is not None and block[1] % BLOCK_MIN_GROUP == 0
            and block_split_fits(k, block[1], sharding))


def _fp8_weight(tensors: dict[str, np.ndarray], block: tuple[int, int] | None,
                keep_blocks: bool = False, static: bool = False) -> Fp8Weight | Fp8BlockWeight:
    values = tensors["weight"]  # [N, K]
    n, k = values.shape
    scale = np.asarray(tensors.get("weight_scale_inv", tensors.get("weight_scale")), np.float32)
    if scale.ndim == 4:  # ModelOpt's block scales [N / bn, 1, K / bk, 1]
        scale = scale[:, 0, :, 0]
    if block is not None and scale.shape == (-(-n // block[0]), -(-k // block[1])):
        if keep_blocks:  # a block's scale on each of its rows
            return Fp8BlockWeight(values, np.repeat(scale, block[0], axis=0)[:n], block[1])
        return requantize_blocks(values, scale, block)
    scale = scale.reshape(-1)
    if scale.size not in (1, n):
        raise ValueError(f"weight_scale of shape {list(scale.shape)} for a [{n}, {k}] weight: "
                         f"only per-tensor, per-channel and block-wise scales (block {block}).")
    return Fp8Weight(values, np.ascontiguousarray(np.broadcast_to(scale, (n,))),
                     _input_scale(tensors) if static else None)


def _input_scale(tensors: dict[str, np.ndarray]) -> np.ndarray:
    """A static-scheme linear's activation scale ([] or [1] in the checkpoint) -> [] float32."""
    if "input_scale" not in tensors:
        raise ValueError("A static activation scheme needs each FP8 linear's input_scale; "
                         f"this linear has {sorted(tensors)}.")
    scale = np.asarray(tensors["input_scale"], np.float32).reshape(-1)
    if scale.size != 1:
        raise ValueError(f"input_scale of shape {list(tensors['input_scale'].shape)}: jaxllm "
                         "reads one static activation scale per tensor.")
    return scale.reshape(())


@functools.partial(jax.jit, static_argnames="block")
def requantize_blocks(values, scale, block: tuple[int, int]) -> Fp8Weight:
    """A block-wise FP8 weight (values [N, K] float8, scale [cdiv(N, bn), cdiv(K, bk)]) ->
    Fp8Weight with one scale per output channel, rounded as `--quantization fp8` rounds a
    16-bit weight (quantize_fp8), on the default device."""
    return quantize_fp8(dequantize_blocks(values, scale, block).T)


def dequantize_blocks(values, scale, block: tuple[int, int]) -> jax.Array:
    """values [N, K] float8, scale [cdiv(N, bn), cdiv(K, bk)] -> w [N, K] float32: each value
    times its block's scale."""
    return jnp.asarray(values).astype(jnp.float32) * block_scales(scale, block, values.shape)


def block_scales(scale, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """scale [cdiv(N, bn), cdiv(K, bk)] -> [N, K] float32: each element's block's scale (the
    last blocks may be partial)."""
    (n, k), (bn, bk) = shape, block
    return jnp.repeat(jnp.repeat(jnp.asarray(scale, jnp.float32), bn, axis=0)[:n], bk,
                      axis=1)[:, :k]


def _unpack_rows(packed: np.ndarray) -> np.ndarray:
    """[R, C] int32, nibble i of word r = row 8r + i -> [8R, C] uint8."""
    words = packed.view(np.uint32)
    nibbles = [(words >> np.uint32(4 * i)) & 0xF for i in range(8)]
    return np.stack(nibbles, axis=1).reshape(-1, packed.shape[1]).astype(np.uint8)


def _unpack_cols(packed: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """[R, C] int32, nibble i of word c = column 8c + order[i] -> [R, 8C] uint8."""
    words = packed.view(np.uint32)
    out = np.empty((packed.shape[0], packed.shape[1], 8), np.uint8)
    for i, column in enumerate(order):
        out[:, :, column] = (words >> np.uint32(4 * i)) & 0xF
    return out.reshape(packed.shape[0], -1)


def unpack_gptq(tensors: dict, qconfig: dict):
    """-> (q [K, N] uint8, zeros [K/g, N] uint8, scales [K/g, N], g_idx [K] or None)."""
    q = _unpack_rows(tensors["qweight"])
    zeros = _unpack_cols(tensors["qzeros"])
    if qconfig.get("checkpoint_format", "gptq") == "gptq":  # v1 stores each zero minus one
        zeros = ((zeros.astype(np.int32) + 1) & 0xF).astype(np.uint8)
    return q, zeros, tensors["scales"], tensors.get("g_idx")


def unpack_awq(tensors: dict):
    """-> (q [K, N] uint8, zeros [K/g, N] uint8, scales [K/g, N])."""
    return (_unpack_cols(tensors["qweight"], _AWQ_ORDER),
            _unpack_cols(tensors["qzeros"], _AWQ_ORDER), tensors["scales"])


def act_order(g_idx: np.ndarray | None, num_groups: int) -> np.ndarray | None:
    """The permutation that makes each group's rows contiguous (None: already in order)."""
    k = 0 if g_idx is None else len(g_idx)
    if g_idx is None:
        return None
    group = k // num_groups
    g_idx = np.asarray(g_idx, np.int64)
    if np.array_equal(g_idx, np.arange(k) // group):
        return None
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], np.arange(k) // group):
        raise ValueError(f"g_idx does not assign {group} rows to each of {num_groups} groups.")
    return perm.astype(np.int32)


def int4_weight(q, zeros, scales, g_idx, dtype, k_shards: int = 1) -> Int4Weight:
    """Host q [K, N] 0..15, zeros and scales [K/g, N] -> Int4Weight of host arrays: rows in act
    order, K in k_shards slices (one per device of a row split), each padded to quant_matmul's
    chunk with zero-scale rows."""
    k, num_groups = q.shape[0], scales.shape[0]
    perm = act_order(g_idx, num_groups)
    if perm is not None:
        q = q[perm]
    group, rows = k // num_groups, k // k_shards
    if k % k_shards or rows % group:
        raise ValueError(f"K={k} in {k_shards} slices of whole groups of {group} rows: "
                         f"{k / k_shards:g} rows per slice.")
    pad = -rows % INT4_CHUNK_ROWS
    if pad % group:
        raise ValueError(f"K={rows} pads to a multiple of {INT4_CHUNK_ROWS} that group {group} "
                         f"does not divide.")

    def padded(a, pad_rows):  # each slice padded on its own
        return np.concatenate([np.pad(s, ((0, pad_rows), (0, 0)))
                               for s in np.split(np.asarray(a), k_shards)])

    scales = padded(np.asarray(scales, np.float32), pad // group).astype(dtype)
    return Int4Weight(pack_int4(padded(q, pad)), scales, padded(zeros, pad // group), perm, k,
                      k_shards)


class QuantizedLinears:
    """Collects the tensors of each quantised linear while the loader reads the files, and
    builds the weights once all are read (their tensors may lie in different files)."""

    def __init__(self, method: str | None, hf_config: dict, dtype) -> None:
        self.method, self.dtype = method, dtype
        self.qconfig = hf_config.get("quantization_config") or {}
        self.tensors: dict[str, dict[str, np.ndarray]] = {}

    def take(self, name: str, host: np.ndarray) -> bool:
        if self.method not in FP8_METHODS + ("gptq", "awq"):
            return False
        base, _, suffix = name.rpartition(".")
        if suffix not in _SUFFIXES or (suffix == "weight" and host.dtype != jnp.float8_e4m3fn):
            return False
        self.tensors.setdefault(base, {})[suffix] = host
        return True

    @staticmethod
    def _log_blocks(block: tuple[int, int], kinds: list[type]) -> None:
        """The start-up log of how a block-wise checkpoint's linears (their loaded kinds) run."""
        requantised = sum(kind is not Fp8BlockWeight for kind in kinds)
        if not requantised:
            logger.info("Block-wise FP8 scales (block %s): block-scaled FP8 kernels, activations "
                        "quantised per token and group of %d.", list(block), block[1])
            return
        logger.warning("Block-wise FP8 scales (block %s): %d of %d linears (MoE experts, "
                       "blocks under %d rows of K, or K split off block boundaries) "
                       "requantised per output channel at load: one more float8 rounding (its "
                       "cost: docs/quantization.md).", list(block), requantised, len(kinds),
                       BLOCK_MIN_GROUP)

    def weights(self, shardings: Callable[[str], NamedSharding | None]):
        """Yields (checkpoint name of the linear's weight, quantised weight) for each linear,
        placed per shardings(checkpoint name of the weight); an MoE expert's FP8 weight is left
        unplaced, for stack_fp8_experts."""
        block = fp8_block_size(self.qconfig)
        if static_activations(self.qconfig):
            logger.info("Static activation scales (one per tensor, the checkpoint's "
                        "input_scale): the W8A8 GEMMs quantise their inputs at them; the "
                        "one-token GEMVs (W8A16) and MoE experts do not quantise activations.")
        elif any("input_scale" in t for t in self.tensors.values()):
            logger.info("The checkpoint's input scales are not used: activations are "
                        "quantised per token (activation_scheme dynamic).")
        kinds = []
        for base, tensors in self.tensors.items():
            if "weight" not in tensors and "qweight" not in tensors:
                raise ValueError(f"Quantised linear {base} has {sorted(tensors)} but no weight.")
            name = f"{base}.weight"
            if "weight" in tensors and split_expert_path(map_hf_name(name)[0])[1] is not None:
                weight = _fp8_weight(tensors, block)
            else:
                weight = build_weight(self.method, tensors, self.qconfig, self.dtype,
                                      shardings(name))
            kinds.append(type(weight))
            yield name, weight
        if block is not None:
            self._log_blocks(block, kinds)


def stack_fp8_experts(experts: list[Fp8Weight]) -> Fp8Experts:
    """One MoE layer's experts, each an FP8 weight (values [N, K], scale [N]; host arrays, or
    device ones where requantised from blocks), in expert order -> Fp8Experts of host arrays
    (values [E, K, N], scale [E, N])."""
    return Fp8Experts(np.stack([np.ascontiguousarray(w.values.T) for w in experts]),
                      np.stack([w.scale for w in experts]))
