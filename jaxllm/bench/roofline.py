"""Hardware floors of a workload from the model shape (the device ceilings they divide by:
`pallas_kernels/ceilings.py`).

A decode step must read every weight it uses once and the KV of every context token; a workload
must do its FLOPs. Floor time = max(bytes / HBM bandwidth, FLOPs / matmul rate); a measured time
divided into it is the achieved fraction (1.0 = at the roofline). Bytes count each element as the
engine stores it (`Storage`: quantised projections and an FP8 KV cache take fewer); FLOPs divide
by the model dtype's matmul rate, also for FP8 GEMMs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from jaxllm.loader.quant_checkpoint import FP8_METHODS
from jaxllm.models.args import ModelArgs
# The ceilings the floors divide by; `measure_ceilings` is re-exported for the bench commands.
from pallas_kernels.ceilings import Ceilings, measure_ceilings  # noqa: F401


@dataclass(frozen=True)
class Storage:
    """Bytes an element takes as the engine stores it: the model dtype's (embedding, LM head), a
    projection weight's, a KV cache element's."""
    dtype: float = 2.0
    projection: float = 2.0
    kv: float = 2.0

    @classmethod
    def of(cls, dtype_bytes: float, quantization: str | None = None, hf_config: dict | None = None,
           kv_cache_dtype: str = "auto") -> "Storage":
        """An engine's: FP8 projections 1 byte (their per-channel scales are under 0.1%), int4
        half a byte plus a 16-bit scale and an 8-bit zero point per group, FP8 KV 1 byte."""
        projection = dtype_bytes
        if quantization in FP8_METHODS:
            projection = 1.0
        elif quantization in ("gptq", "awq"):
            qconfig = (hf_config or {}).get("quantization_config") or {}
            projection = 0.5 + 3 / qconfig.get("group_size", qconfig.get("q_group_size", 128))
        return cls(dtype_bytes, projection, dtype_bytes if kv_cache_dtype == "auto" else 1.0)

    @classmethod
    def of_engine(cls, config) -> "Storage":
        """An EngineConfig's (the model dtype as the engine resolved it)."""
        from jaxllm.loader.loader import resolve_dtype
        model = config.model_config
        return cls.of(resolve_dtype(model.dtype).itemsize, model.quantization, model.hf_config,
                      config.cache_config.kv_cache_dtype)


# -- the model shape ------------------------------------------------------------------------------
def _layer_params(args: ModelArgs, layer_index: int, experts_read: float) -> float:
    """Matmul weights of one layer touched when experts_read of its experts are used (norms and
    biases are negligible)."""
    h = args.hidden_size
    attention = h * (args.q_size + 2 * args.kv_size) + args.q_size * h
    if args.layer_mlp_kind(layer_index) != "moe":
        return attention + 3 * h * args.intermediate_size
    shared = 3 * h * args.shared_expert_intermediate_size + h * args.num_experts  # + router
    return attention + shared + experts_read * 3 * h * args.moe_intermediate_size


def kv_bytes_per_token(args: ModelArgs, kv_bytes: float = 2) -> float:
    return 2 * args.num_layers * args.kv_size * kv_bytes


def active_params_per_token(args: ModelArgs) -> float:
    """Matmul weights one token multiplies by: its layers (top-k experts) and the LM head."""
    return (sum(_layer_params(args, i, args.num_experts_per_tok) for i in range(args.num_layers))
            + args.hidden_size * args.vocab_size)


def weight_bytes_per_step(args: ModelArgs, batch_size: int,
                          storage: Storage = Storage()) -> float:
    """Weights a step over batch_size tokens reads: layers (projections as stored), LM head,
    batch_size embedding rows; of an MoE layer, the experts the batch is expected to hit under
    uniform routing."""
    experts_hit = 0.0
    if args.num_experts:
        experts_hit = args.num_experts * (1 - (1 - args.num_experts_per_tok / args.num_experts)
                                          ** batch_size)
    layers = sum(_layer_params(args, i, experts_hit) for i in range(args.num_layers))
    return (layers * storage.projection
            + args.hidden_size * (args.vocab_size + batch_size) * storage.dtype)


def attention_flops(args: ModelArgs, context_len: float) -> float:
    """QK^T and PV of one query token over context_len keys, all layers."""
    return 4 * context_len * args.num_heads * args.head_dim * args.num_layers


# -- floors ---------------------------------------------------------------------------------------
def decode_step_floor(args: ModelArgs, batch_size: int, context_len: int, ceilings: Ceilings,
                      storage: Storage = Storage()) -> dict:
    """One decode step of batch_size sequences, each attending over context_len tokens."""
    step_bytes = (weight_bytes_per_step(args, batch_size, storage)
                  + batch_size * context_len * kv_bytes_per_token(args, storage.kv))
    flops = batch_size * (2 * active_params_per_token(args) + attention_flops(args, context_len))
    return _floor(step_bytes, flops, ceilings)


def mesh_decode_step_floor(args: ModelArgs, batch_size: int, context_len: int,
                           ceilings: Ceilings, tp: int, dp: int,
                           storage: Storage = Storage()) -> dict:
    """One decode step on a DP x PP x TP mesh of devices with one device's `ceilings`: each DP
    replica runs its share of the batch, reading all the weights; the TP devices of a stage share
    its reads; the PP stages of one step run one after another, so PP does not divide it (it
    divides a workload's floor, where every stage has a batch: `workload_floor` over all
    devices)."""
    return decode_step_floor(args, -(-batch_size // dp), context_len, ceilings.times(tp),
                             storage)


def workload_floor(args: ModelArgs, prompt_lens, output_lens, max_num_seqs: int,
                   ceilings: Ceilings, storage: Storage = Storage()) -> dict:
    """Offline run of requests (prompt_lens[i] in, output_lens[i] out) at most max_num_seqs at a
    time. Memory: every decode step reads the weights (at least max(longest output, total output /
    max_num_seqs) steps) and each generated token reads its context's KV once."""
    p = np.asarray(prompt_lens, np.float64)
    o = np.asarray(output_lens, np.float64)
    # Token t of a request attends over its position: prompt sum = p^2/2, output sum = p*o + o^2/2.
    attended = p * p / 2 + p * o + o * o / 2
    flops = (2 * active_params_per_token(args) * (p + o).sum()
             + 4 * attended.sum() * args.num_heads * args.head_dim * args.num_layers)
    steps = max(o.max(), math.ceil(o.sum() / max_num_seqs))
    batch = min(max_num_seqs, len(o))
    kv_read = (p * o + o * o / 2).sum() * kv_bytes_per_token(args, storage.kv)
    return _floor(steps * weight_bytes_per_step(args, batch, storage) + kv_read, flops, ceilings)


def _floor(num_bytes: float, flops: float, ceilings: Ceilings) -> dict:
    memory_s = float(num_bytes) / ceilings.hbm_bytes_per_s
    compute_s = float(flops) / ceilings.matmul_flops_per_s
    return {"bytes": float(num_bytes), "flops": float(flops), "memory_s": memory_s,
            "compute_s": compute_s, "floor_s": max(memory_s, compute_s),
            "bound": "memory" if memory_s >= compute_s else "compute"}


def describe(floor: dict, measured_s: float) -> str:
    """'floor 3.55 ms (memory-bound), achieved 91.2% of the floor'"""
    return (f"floor {_seconds(floor['floor_s'])} ({floor['bound']}-bound), achieved "
            f"{100 * floor['floor_s'] / measured_s:.1f}% of the floor")


def _seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def model_args_of(model: str | None, load_format: str = "auto") -> ModelArgs:
    """The shape the engine loads for `model`, read without loading weights."""
    import json
    import os

    from jaxllm.models.presets import PRESETS

    if load_format == "dummy" and model in PRESETS:
        return ModelArgs.from_hf_config(PRESETS[model])
    if model is None:
        from jaxllm.loader.default_model import default_model_dir
        model = default_model_dir()
    elif model.endswith(".gguf"):
        from jaxllm.loader.default_model import converted_gguf_dir
        model = converted_gguf_dir(model)
    with open(os.path.join(model, "config.json")) as f:
        return ModelArgs.from_hf_config(json.load(f))
