"""Builds engines from an EngineConfig: the model loaded onto its mesh, the KV cache sized from
the memory left, the runner warmed up; and which engine a parallel layout needs."""

from __future__ import annotations

import gc
import logging
from dataclasses import replace
from functools import partial

import jax

from jaxllm.config import EngineConfig
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine import compilation_cache
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.dp_engine import DPEngine
from jaxllm.engine.engine_core import EngineCore
from jaxllm.engine.model_setup import ShardedModel, engine_mesh, load_for_engine
from jaxllm.engine.pooling_builder import build_pooling_engine
from jaxllm.loader.eagle_loader import load_eagle_head, read_eagle_args
from jaxllm.models import ModelArgs
from jaxllm.models import quant
from jaxllm.models.attention import attention_backend
from jaxllm.sharding.mesh import make_mesh
from jaxllm.spec_decode.ngram_proposer import NgramProposer
from jaxllm.spec_decode.proposer import Proposer
from jaxllm.worker import kv_cache
from jaxllm.worker.drafter import Drafter, EagleDraft, ModelDraft
from jaxllm.worker.lora_slots import make_lora_slots
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.pipeline import FrontStage, Pipeline

logger = logging.getLogger("jaxllm")
# Tracked objects allocated (net of those freed) before a young collection; Python's is 700
YOUNG_COLLECTION_OBJECTS = 50_000


def make_engine(engine_args: EngineArgs | EngineConfig, log=logger.info):
    """An EngineCore; with data_parallel_size > 1 a DPEngine of replicas, except for an MoE
    model with enable_expert_parallel: then vLLM's DP attention, one EngineCore over the whole
    [DP, TP] mesh (attention per DP rank, experts split over all DP x TP devices)."""
    config = (engine_args.create_engine_config() if isinstance(engine_args, EngineArgs)
              else engine_args)
    if config.pooler_config is not None:  # --runner pooling: a PoolingEngine
        compilation_cache.enable(config.runner_config.compilation_cache_dir)
        return build_pooling_engine(config, log)
    parallel = config.parallel_config
    if parallel.data_parallel_size == 1:
        return build_engine_core(config, log)
    if (parallel.enable_expert_parallel
            and ModelArgs.from_hf_config(config.model_config.hf_config).num_experts):
        mesh = make_mesh(parallel)
        ep = mesh.shape["data"] * mesh.shape["tensor"]
        log(f"DP attention: {parallel.data_parallel_size} DP ranks step together, experts "
            f"split over the {ep} devices of each stage (expert parallel size {ep})")
        return build_engine_core(config, log, mesh)
    return DPEngine(config, build_engine_core, log)


def build_engine_core(config: EngineConfig, log=logger.info, mesh=None) -> EngineCore:
    """TP (and EP within it) runs on `mesh`; a mesh with DP > 1 rows is DP attention: one
    scheduler and KV pool per rank, one step. A drafter (EAGLE head, draft model) is loaded
    before the KV cache is sized: its KV pages are counted in every block."""
    compilation_cache.enable(config.runner_config.compilation_cache_dir)
    mesh = mesh if mesh is not None else engine_mesh(config)
    dp_size = 1 if mesh is None else mesh.shape["data"]
    sharded = load_for_engine(config, mesh)
    sharded.draft = _load_draft(config, sharded, log)
    num_blocks = config.cache_config.num_gpu_blocks_override
    if num_blocks is None:
        block_bytes = _block_bytes(config, sharded) + _draft_block_bytes(config, sharded)
        num_blocks = _measure_num_blocks(config, sharded, dp_size, block_bytes, mesh)
    num_blocks = _addressable_blocks(config, sharded, dp_size, num_blocks, log)
    return _assemble_core(config, sharded, dp_size, num_blocks, log, _make_proposer(config))


def _addressable_blocks(config: EngineConfig, sharded: ShardedModel, dp_size: int,
                        num_blocks: int, log) -> int:
    """num_blocks within what the kernels can address in one page array (kv_cache.py)."""
    args = sharded.args
    capped = kv_cache.cap_num_blocks(num_blocks, dp_size, config.cache_config.block_size,
                                     args.num_kv_heads // sharded.tp, args.head_dim,
                                     _kv_cache_dtype(config, sharded))
    if capped < num_blocks:
        log(f"KV cache: {num_blocks} blocks capped to {capped}: a float8 page array holds at "
            "most 2 GiB")
    return capped


def _assemble_core(config: EngineConfig, sharded: ShardedModel, dp_size: int, num_blocks: int,
                   log, proposer: Proposer | None = None) -> EngineCore:
    """The KV cache, runner and schedulers of a loaded model, warmed up."""
    cache = config.cache_config
    block_bytes = _block_bytes(config, sharded)
    kv_cache.check_fits(num_blocks, cache.block_size, config.model_config.max_model_len,
                        block_bytes)
    log(f"Quantization: {config.model_config.quantization or 'none'}; KV cache: {num_blocks} "
        f"blocks of {cache.block_size} tokens, {_kv_cache_dtype(config, sharded)}"
        f" ({num_blocks * block_bytes / kv_cache.GiB:.2f} GiB)"
        + (f" per DP rank, {dp_size} ranks" if dp_size > 1 else "")
        + _kv_scales_note(config, sharded))
    runner = _make_runner(config, sharded, dp_size, num_blocks)
    lora, pp = config.lora_config, config.parallel_config.pipeline_parallel_size
    schedulers = [Scheduler(config.scheduler_config, cache, num_blocks, config.speculative_config,
                            max_loras=lora.max_loras if lora else None,
                            batch_queue_size=pp if pp > 1 else None)
                  for _ in range(dp_size)]
    loaded = sharded.loaded
    core = EngineCore(config, runner, schedulers, loaded.tokenizer,
                      set(loaded.eos_token_ids), loaded.args.vocab_size, num_blocks, proposer)
    if not config.runner_config.enforce_eager:
        runner.warmup(progress=log)
    # As vLLM: what start-up allocated leaves the collector's generations, so a full collection
    # while serving scans only what serving allocates (a long one stalls the step pipeline).
    # And a young collection waits for many more new objects than Python's default: each step
    # allocates thousands that die within a step or two, every young collection promoted those
    # still alive, and the promoted garbage set off the full collections.
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_OBJECTS, *gc.get_threshold()[1:])
    return core


def _load_draft(config: EngineConfig, sharded: ShardedModel, log):
    """(EagleDraft or ModelDraft, its params) for a drafter, or None; binds EAGLE-3's feature
    layers into the target's forward."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    log(f"{spec.method} for speculative decoding: {spec.model}")
    if spec.method == "draft_model":
        draft = load_for_engine(replace(config, model_config=spec.draft_model_config), None)
        return ModelDraft(draft.args), draft.loaded.params
    head = read_eagle_args(spec.model, spec.method, sharded.args)
    params = load_eagle_head(spec.model, head, jax.tree.leaves(sharded.loaded.params)[0].dtype)
    if head.eagle3:
        sharded.model_fn = partial(sharded.model_fn, aux_layers=head.aux_layers)
    return EagleDraft(head), params


def _draft_block_bytes(config: EngineConfig, sharded: ShardedModel) -> int:
    """The drafter's KV per block (in its dtype)."""
    if sharded.draft is None:
        return 0
    draft, params = sharded.draft
    layers, num_kv_heads, head_dim = draft.kv_layout
    return kv_cache.bytes_per_block(layers, config.cache_config.block_size, num_kv_heads,
                                    head_dim, draft.dtype(params))


def _make_drafter(config: EngineConfig, sharded: ShardedModel, num_blocks: int):
    if sharded.draft is None:
        return None
    draft, params = sharded.draft
    layers, num_kv_heads, head_dim = draft.kv_layout
    block_size = config.cache_config.block_size
    cache = kv_cache.allocate_kv_caches(layers, num_blocks, block_size, num_kv_heads, head_dim,
                                        draft.dtype(params))
    attn, _ = attention_backend(config.runner_config.attention_backend)
    return Drafter(draft, params, cache, config.speculative_config.num_speculative_tokens, attn,
                   block_size)


def _make_proposer(config: EngineConfig) -> Proposer | None:
    """The host-side proposer (n-gram); None without one (a drafter drafts inside the
    runner)."""
    spec = config.speculative_config
    if spec is None or spec.method != "ngram":
        return None
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                         spec.prompt_lookup_max, config.model_config.max_model_len)


def _kv_scales_note(config: EngineConfig, sharded: ShardedModel) -> str:
    """What becomes of a checkpoint's static KV scales: only a float8 cache uses them (vLLM)."""
    if not sharded.args.kv_cache_scales:
        return ""
    if config.cache_config.kv_cache_dtype == "auto":
        return "; the checkpoint's KV cache scales are unused (--kv-cache-dtype fp8 uses them)"
    return "; KV cache scales per layer from the checkpoint"


def _kv_cache_dtype(config: EngineConfig, sharded: ShardedModel):
    """The pages' dtype: the model's, or float8_e4m3fn for --kv-cache-dtype fp8 / fp8_e4m3."""
    return kv_cache.cache_dtype(config.cache_config.kv_cache_dtype,
                                jax.tree.leaves(sharded.loaded.params)[0].dtype)


def _block_bytes(config: EngineConfig, sharded: ShardedModel) -> int:
    """K and V of one block over all layers of the largest stage, per device (the cache splits KV
    heads over TP, layers over pipeline stages)."""
    args = sharded.args
    return kv_cache.bytes_per_block(max(sharded.kv_layers), config.cache_config.block_size,
                                    args.num_kv_heads // sharded.tp, args.head_dim,
                                    _kv_cache_dtype(config, sharded))


def _make_runner(config: EngineConfig, sharded: ShardedModel, dp_size: int,
                 num_blocks: int) -> ModelRunner:
    args, sched = sharded.args, config.scheduler_config
    dtype = _kv_cache_dtype(config, sharded)
    allocate = partial(kv_cache.allocate_kv_caches, num_blocks=dp_size * num_blocks,
                       block_size=config.cache_config.block_size, num_kv_heads=args.num_kv_heads,
                       head_dim=args.head_dim, dtype=dtype)
    caches = allocate(sharded.kv_layers[-1], sharding=sharded.kv_cache_sharding)
    return ModelRunner(sharded.model_fn, sharded.loaded.params, caches,
                       vocab_size=args.vocab_size, block_size=config.cache_config.block_size,
                       max_model_len=config.model_config.max_model_len,
                       max_num_seqs=sched.max_num_seqs,
                       max_num_batched_tokens=sched.max_num_batched_tokens, dp_size=dp_size,
                       lean_steps=config.runner_config.lean_steps, **_spec_runner_args(config),
                       pipeline=_make_pipeline(sharded, allocate),
                       lora_slots=_lora_slots(config, sharded),
                       drafter=_make_drafter(config, sharded, dp_size * num_blocks),
                       one_token_bucket=_runs_gemv(sharded, dp_size))


def _runs_gemv(sharded: ShardedModel, dp_size: int) -> bool:
    """Whether one-token steps take the quantised weights' GEMVs (one device, FP8 or int4
    projections)."""
    return (sharded.tp == 1 and sharded.pipeline is None and dp_size == 1
            and quant.has_gemv_weights(sharded.loaded.params))


def _lora_slots(config: EngineConfig, sharded: ShardedModel):
    """The LoRA slots in the model's dtype; None without LoRA (whose pipeline stages, the only
    place a step's params lack the embedding, it refuses)."""
    if config.lora_config is None:
        return None
    return make_lora_slots(config.lora_config, sharded.args, sharded.loaded.params["embed"].dtype)


def _make_pipeline(sharded: ShardedModel, allocate) -> Pipeline | None:
    """The stages before the last, each with its own KV cache (pipeline parallelism)."""
    if sharded.pipeline is None:
        return None
    plans = sharded.pipeline.stages
    front = [FrontStage(params, model_fn, allocate(layers, sharding=plan.kv_cache_sharding),
                        plan.mesh)
             for (params, model_fn), plan, layers in zip(sharded.front_stages, plans,
                                                         sharded.kv_layers)]
    return Pipeline(front, plans[-1].mesh)


def _spec_runner_args(config: EngineConfig) -> dict:
    """At most disable_by_batch_size - 1 sequences carry drafts in a step (Scheduler)."""
    spec = config.speculative_config
    if spec is None:
        return {}
    return {"num_spec_tokens": spec.num_speculative_tokens,
            "max_spec_seqs": spec.disable_by_batch_size - 1}


def _measure_num_blocks(config: EngineConfig, sharded: ShardedModel, dp_size: int,
                        block_bytes: int, mesh) -> int:
    """kv_cache_memory_bytes when given (vLLM's override of the measurement); else on a GPU the
    blocks that fit in the memory gpu_memory_utilization leaves after the weights and a profiled
    step's activations, and on a CPU a fixed budget."""
    cache = config.cache_config
    if cache.kv_cache_memory_bytes is not None:
        return max(cache.kv_cache_memory_bytes // block_bytes, 0)
    if kv_cache.device_memory_limit() is None:
        return max(kv_cache.CPU_KV_CACHE_BYTES // block_bytes, 0)
    probe = _make_runner(config, sharded, dp_size, 2)
    available = kv_cache.device_memory_available(
        cache.gpu_memory_utilization, probe.activation_bytes(),
        None if mesh is None else mesh.devices.flat[0])
    del probe
    return max(int(available // block_bytes), 0)

