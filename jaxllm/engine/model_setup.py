"""The model an EngineCore runs, on its mesh: the weights loaded shard by shard, the step's model
function (attention backend bound) and the KV cache sharding."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Callable

from jax.sharding import Mesh

from jaxllm.config import EngineConfig
from jaxllm.loader import load_model, resolve_dtype
from jaxllm.loader.hf_names import flatten_paths
from jaxllm.loader.quant_checkpoint import FP8_METHODS, static_activations
from jaxllm.models import ModelArgs, forward, fuse_params, param_shapes
from jaxllm.models.attention import attention_backend
from jaxllm.models.layer_stacks import stack_layers
from jaxllm.models.quant import EXPERT_NAMES, quantize_params_fp8
from jaxllm.sharding.mesh import make_mesh, stage_meshes, validate_model_parallelism
from jaxllm.sharding.pipeline import PipelinePlan
from jaxllm.sharding.rules import ShardingPlan
from jaxllm.worker.kv_cache import GiB, device_memory_limit
from jaxllm.worker.pipeline import last_stage_forward, stage_forward


@dataclasses.dataclass
class ShardedModel:
    loaded: object  # LoadedModel, params placed per the plan
    args: ModelArgs  # the args the step runs with (KV heads as in the KV cache)
    model_fn: Callable  # (params, kv_caches, batch) -> (logits, kv_caches)
    kv_cache_sharding: object  # None on one device
    tp: int = 1
    # Pipeline parallelism: loaded.params, model_fn and kv_cache_sharding are the last stage's;
    # these are the stages before it (params placed, KV caches not yet allocated).
    pipeline: PipelinePlan | None = None
    front_stages: list = dataclasses.field(default_factory=list)  # [(params, model_fn)]
    draft: tuple | None = None  # (EagleDraft or ModelDraft, params): speculative decoding's

    @property
    def kv_layers(self) -> list[int]:
        """Layers per stage (one stage without pipeline parallelism)."""
        if self.pipeline is None:
            return [self.args.num_layers]
        return [end - start for start, end in self.pipeline.layers]


def engine_mesh(config: EngineConfig) -> Mesh | None:
    """The mesh of one engine replica ([1, PP, TP]); None for a single device."""
    parallel = config.parallel_config
    if parallel.tensor_parallel_size == 1 and parallel.pipeline_parallel_size == 1:
        return None
    return make_mesh(dataclasses.replace(parallel, data_parallel_size=1))


def _fp8_at_load(config: EngineConfig) -> Callable | None:
    """quantize_params_fp8, bound, where the loaded 16-bit weights become FP8: `--quantization
    fp8` on a 16-bit checkpoint, and dummy weights standing in for an FP8 checkpoint (its static
    activation scales, if any, as 1: quant_checkpoint.check_dummy); else None."""
    model = config.model_config
    qconfig = model.hf_config.get("quantization_config")
    dummy = config.load_config.load_format == "dummy"
    if not (model.quantization == "fp8" and not qconfig
            or dummy and model.quantization in FP8_METHODS):
        return None
    static = bool(qconfig) and static_activations(qconfig)
    return partial(quantize_params_fp8, input_scale=1.0 if static else None)


def check_fp8_load_fits(config: EngineConfig, mesh: Mesh | None) -> None:
    """Quantising at load holds the 16-bit weights first (as vLLM's online FP8 does); where they
    cannot fit jax's pool the engine is refused before loading, not left to run out of memory
    in an allocation."""
    limit = device_memory_limit()
    if limit is None:
        return
    model = config.model_config
    shapes = flatten_paths(param_shapes(ModelArgs.from_hf_config(model.hf_config)))
    shards = 1 if mesh is None else mesh.shape["tensor"] * mesh.shape["pipe"]
    # expert parallelism splits the experts over "data" too (sharding/rules.py)
    expert_shards = shards * (mesh.shape["data"] if mesh is not None
                              and config.parallel_config.enable_expert_parallel else 1)
    dtype = resolve_dtype(model.dtype)
    needed = dtype.itemsize * sum(
        math.prod(shape) / (expert_shards if path.rsplit(".", 1)[-1] in EXPERT_NAMES else shards)
        for path, shape in shapes.items())
    if needed > limit:
        raise ValueError(
            f"Quantizing {model.model} to FP8 at load holds its {dtype.name} weights first: "
            f"about {needed / GiB:.1f} GiB a device, more than the {limit / GiB:.1f} GiB that "
            f"gpu_memory_utilization={config.cache_config.gpu_memory_utilization:g} gives. "
            f"Raise gpu_memory_utilization, split the model over more GPUs "
            f"(tensor_parallel_size), or load an FP8 checkpoint.")


def load_for_engine(config: EngineConfig, mesh: Mesh | None) -> ShardedModel:
    """Loads the model onto `mesh` (each device reading only its shards), fuses its projections
    into the compute layout (jaxllm/models/fused.py), on one device stacks the layers' small
    arrays (jaxllm/models/layer_stacks.py) and binds forward to the sharded args, the
    attention backend and the KV write."""
    model = config.model_config
    attn, write_kv = attention_backend(config.runner_config.attention_backend)
    load = partial(load_model, model.model, model.dtype, config.load_config.load_format,
                   model.seed, tokenizer=model.tokenizer, quantization=model.quantization)
    quantize = _fp8_at_load(config)
    if quantize:
        check_fp8_load_fits(config, mesh)
    if mesh is None:
        loaded = load()
        loaded.params = fuse_params(loaded.params, loaded.args.num_kv_heads, free_inputs=True)
        if quantize:
            loaded.params = quantize(loaded.params)
        loaded.params = stack_layers(loaded.params)
        return ShardedModel(loaded, loaded.args, partial(forward, args=loaded.args, attn=attn,
                                                         write_kv=write_kv), None)
    expert_parallel = config.parallel_config.enable_expert_parallel
    parallel = dataclasses.replace(config.parallel_config, tensor_parallel_size=mesh.shape["tensor"],
                                   data_parallel_size=mesh.shape["data"])
    args = ModelArgs.from_hf_config(model.hf_config)
    validate_model_parallelism(args, parallel)
    if mesh.shape["pipe"] > 1:
        return _load_pipeline(PipelinePlan.build(mesh, args, expert_parallel), load, attn,
                              write_kv)
    plan = ShardingPlan(stage_meshes(mesh)[0], args, expert_parallel)
    loaded = load(shardings=plan.param_sharding)
    loaded.params = fuse_params(plan.shard_params(loaded.params), plan.model_args.num_kv_heads,
                                plan.param_sharding, free_inputs=True)
    if quantize:
        loaded.params = quantize(loaded.params, plan.param_sharding)
    return ShardedModel(loaded, plan.model_args, plan.model_fn(forward, attn, write_kv),
                        plan.kv_cache_sharding, plan.tp)


def _load_pipeline(pipeline: PipelinePlan, load: Callable, attn, write_kv) -> ShardedModel:
    """Each stage's weights loaded onto its own devices and fused there; the stages before the
    last as (params, stage model function), the last as the ShardedModel's own."""
    loaded = load(shardings=pipeline.param_sharding)
    stages = [fuse_params(params, plan.model_args.num_kv_heads, plan.param_sharding,
                          free_inputs=True)
              for plan, params in zip(pipeline.stages, pipeline.split_params(loaded.params))]
    front = [(params, plan.model_fn(stage_forward, attn, write_kv))
             for plan, params in zip(pipeline.stages[:-1], stages[:-1])]
    last = pipeline.stages[-1]
    loaded.params = stages[-1]
    return ShardedModel(loaded, last.model_args, last.model_fn(last_stage_forward, attn, write_kv),
                        last.kv_cache_sharding, last.tp, pipeline, front)

