"""The device mesh of one engine: axes ("data", "pipe", "tensor") and vLLM's checks on the
TP/DP/PP/EP sizes.

Axes:
  data   (size DP): DP ranks. Dense models (and MoE without EP): engine replicas, each an
                    EngineCore on its own [1, PP, TP] slice, so inside one step the data axis has
                    size 1. MoE with EP: DP attention, one EngineCore over the whole mesh whose
                    step splits tokens and KV pools over "data" (see engine/dp_engine.py).
  pipe   (size PP): pipeline stages, each holding a contiguous range of layers (and their KV
                    cache); the first also the embedding, the last the final norm, LM head and
                    sampler (sharding/pipeline.py). A program runs on one stage's [DP, TP] mesh
                    (`stage_meshes`), with the axes ("data", "tensor") of AXES.
  tensor (size TP): attention heads, MLP columns/rows, vocab, KV heads.
Experts have no axis of their own: with enable_expert_parallel they are split whole across
("data", "tensor") of the stage mesh they run on, so EP size = TP x DP of that mesh (vLLM's rule).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxllm.config import ParallelConfig
from jaxllm.sharding.axes import AXES, DATA, MESH_AXES, PIPE, TENSOR

logger = logging.getLogger(__name__)


def make_mesh(parallel_config: ParallelConfig, devices=None) -> Mesh:
    """A [DP, PP, TP] mesh over the first DP x PP x TP devices (jax.devices() by default)."""
    devices = list(jax.devices() if devices is None else devices)
    tp, dp = parallel_config.tensor_parallel_size, parallel_config.data_parallel_size
    pp = parallel_config.pipeline_parallel_size
    world_size = parallel_config.world_size
    if world_size > len(devices):
        raise ValueError(
            f"World size ({world_size} = tensor_parallel_size {tp} x data_parallel_size {dp} x "
            f"pipeline_parallel_size {pp}) is larger than the number of available devices "
            f"({len(devices)}).")
    if parallel_config.enable_expert_parallel and tp * dp == 1:
        logger.warning("enable_expert_parallel is set but tensor_parallel_size x "
                       "data_parallel_size = 1: expert parallelism has no effect.")
    grid = np.array(devices[:world_size], dtype=object).reshape(dp, pp, tp)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def replica_meshes(mesh: Mesh) -> list[Mesh]:
    """One [1, PP, TP] mesh per data-parallel rank (the devices of one engine replica)."""
    return [Mesh(mesh.devices[i:i + 1], MESH_AXES, axis_types=(AxisType.Auto,) * 3)
            for i in range(mesh.shape[DATA])]


def stage_meshes(mesh: Mesh) -> list[Mesh]:
    """One [DP, TP] mesh per pipeline stage: the devices one stage's programs run on."""
    return [Mesh(mesh.devices[:, s], AXES, axis_types=(AxisType.Auto, AxisType.Auto))
            for s in range(mesh.shape[PIPE])]


def expert_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[DATA] * mesh.shape[TENSOR]


def validate_model_parallelism(args, parallel_config: ParallelConfig) -> None:
    """vLLM's divisibility checks of a model's shapes against TP (and EP)."""
    tp = parallel_config.tensor_parallel_size
    if args.num_heads % tp:
        raise ValueError(f"Total number of attention heads ({args.num_heads}) must be divisible "
                         f"by tensor parallel size ({tp}).")
    kv = args.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise ValueError(f"Total number of key-value heads ({kv}) must be divisible by tensor "
                         f"parallel size ({tp}), or tensor parallel size must be divisible by it "
                         f"(the KV heads are then replicated).")
    if args.vocab_size % tp:
        raise ValueError(f"Vocabulary size ({args.vocab_size}) must be divisible by tensor "
                         f"parallel size ({tp}) for the vocab-parallel embedding.")
    for name in _mlp_widths(args):
        width = getattr(args, name)
        if width and width % tp:
            raise ValueError(f"{name} ({width}) must be divisible by tensor parallel size ({tp}).")
    if args.num_experts and parallel_config.enable_expert_parallel:
        # Experts are split whole across the mesh one program runs on: TP devices for a DPEngine
        # replica, TP x DP under DP attention (the caller passes that mesh's sizes).
        ep = parallel_config.tensor_parallel_size * parallel_config.data_parallel_size
        if args.num_experts % ep:
            raise ValueError(f"Number of experts ({args.num_experts}) must be divisible by the "
                             f"expert parallel size ({ep}).")


def _mlp_widths(args) -> tuple[str, ...]:
    names = ("intermediate_size",) if (not args.num_experts or args.dense_layers) else ()
    if args.num_experts:
        names += ("moe_intermediate_size", "shared_expert_intermediate_size")
    return names
