"""What an EngineCore needs to run on a mesh: the model loaded shard by shard, the step's model
function and the KV cache sharding (used by EngineCore)."""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial
from typing import Callable

from jax.sharding import Mesh

from jaxllm.config import ParallelConfig
from jaxllm.loader import load_model
from jaxllm.models import ModelArgs, forward, fuse_params
from jaxllm.models.presets import PRESETS
from jaxllm.sharding.mesh import make_mesh, validate_model_parallelism
from jaxllm.sharding.rules import ShardingPlan


@dataclasses.dataclass
class ShardedModel:
    loaded: object  # LoadedModel, params placed per the plan
    args: ModelArgs  # the args the step runs with (KV heads as in the KV cache)
    model_fn: Callable  # (params, kv_caches, batch) -> (logits, kv_caches)
    kv_cache_sharding: object  # None on one device
    tp: int = 1


def engine_mesh(engine_args) -> Mesh | None:
    """The mesh of one engine replica ([1, TP]); None for a single device."""
    if engine_args.tensor_parallel_size == 1:
        return None
    return make_mesh(ParallelConfig(engine_args.tensor_parallel_size, 1,
                                    engine_args.enable_expert_parallel))


def peek_model_args(model: str | None, load_format: str) -> ModelArgs | None:
    """ModelArgs from a preset or config.json without loading weights (None if unknown yet)."""
    if load_format == "dummy" and model in PRESETS:
        return ModelArgs.from_hf_config(PRESETS[model])
    config = os.path.join(model, "config.json") if model else ""
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        return ModelArgs.from_hf_config(json.load(f))


def load_for_engine(engine_args, mesh: Mesh | None, attn: Callable,
                    write_kv: Callable) -> ShardedModel:
    """Loads the model onto `mesh` (each device reading only its shards where the config is known
    up front), fuses its projections into the compute layout (jaxllm/models/fused.py) and binds
    forward to the sharded args, attention and KV write."""
    load = partial(load_model, engine_args.model, engine_args.dtype, engine_args.load_format,
                   engine_args.seed, tokenizer=engine_args.tokenizer)
    if mesh is None:
        loaded = load()
        loaded.params = fuse_params(loaded.params, loaded.args.num_kv_heads, free_inputs=True)
        return ShardedModel(loaded, loaded.args, partial(forward, args=loaded.args, attn=attn,
                                                         write_kv=write_kv), None)
    parallel = ParallelConfig(mesh.shape["tensor"], mesh.shape["data"],
                              engine_args.enable_expert_parallel)
    args = peek_model_args(engine_args.model, engine_args.load_format)
    plan = None
    if args is not None:
        validate_model_parallelism(args, parallel)
        plan = ShardingPlan(mesh, args, engine_args.enable_expert_parallel)
    loaded = load(shardings=plan.param_sharding if plan else None)
    if plan is None:  # e.g. the default GGUF model: loaded on one device, then re-placed
        validate_model_parallelism(loaded.args, parallel)
        plan = ShardingPlan(mesh, loaded.args, engine_args.enable_expert_parallel)
    loaded.params = fuse_params(plan.shard_params(loaded.params), plan.model_args.num_kv_heads,
                                plan.param_sharding, free_inputs=True)
    return ShardedModel(loaded, plan.model_args, plan.model_fn(forward, attn, write_kv),
                        plan.kv_cache_sharding, plan.tp)
