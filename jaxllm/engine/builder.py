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
from jaxllm.engine.draft_proposer import DraftModelProposer
from jaxllm.engine.engine_core import EngineCore
from jaxllm.engine.model_setup import ShardedModel, engine_mesh, load_for_engine
from jaxllm.engine.pooling_builder import build_pooling_engine
from jaxllm.loader.eagle_loader import load_eagle_head, read_eagle_args
from jaxllm.models import ModelArgs
from jaxllm.models.attention import attention_backend
from jaxllm.sharding.mesh import make_mesh
from jaxllm.spec_decode.ngram_proposer import NgramProposer
from jaxllm.spec_decode.proposer import Proposer
from jaxllm.worker import kv_cache
from jaxllm.worker.eagle_drafter import EagleDrafter
from jaxllm.worker.lora_slots import make_lora_slots
from jaxllm.worker.model_runner import ModelRunner
from jaxllm.worker.pipeline import FrontStage, Pipeline

logger = logging.getLogger("jaxllm")


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
    scheduler and KV pool per rank, one step. With a draft model both models are loaded before
    the KV cache is sized: the draft's pool holds as many blocks as the target's."""
    compilation_cache.enable(config.runner_config.compilation_cache_dir)
    mesh = mesh if mesh is not None else engine_mesh(config)
    dp_size = 1 if mesh is None else mesh.shape["data"]
    sharded = load_for_engine(config, mesh)
    draft = _load_draft(config, log)
    sharded.eagle = _load_eagle(config, sharded, log)
    num_blocks = config.cache_config.num_gpu_blocks_override
    if num_blocks is None:
        block_bytes = (_block_bytes(config, sharded) + (_block_bytes(*draft) if draft else 0)
                       + _eagle_block_bytes(config, sharded))
        num_blocks = _measure_num_blocks(config, sharded, dp_size, block_bytes, mesh)
    proposer = _make_proposer(config, draft, num_blocks, log)
    return _assemble_core(config, sharded, dp_size, num_blocks, log, proposer)


def _assemble_core(config: EngineConfig, sharded: ShardedModel, dp_size: int, num_blocks: int,
                   log, proposer: Proposer | None = None, detokenize: bool = True) -> EngineCore:
    """The KV cache, runner and schedulers of a loaded model, warmed up."""
    cache = config.cache_config
    block_bytes = _block_bytes(config, sharded)
    kv_cache.check_fits(num_blocks, cache.block_size, config.model_config.max_model_len,
                        block_bytes)
    log(f"Quantization: {config.model_config.quantization or 'none'}; KV cache: {num_blocks} "
        f"blocks of {cache.block_size} tokens, {_kv_cache_dtype(config, sharded)}"
        f" ({num_blocks * block_bytes / kv_cache.GiB:.2f} GiB)"
        + (f" per DP rank, {dp_size} ranks" if dp_size > 1 else ""))
    runner = _make_runner(config, sharded, dp_size, num_blocks)
    lora, pp = config.lora_config, config.parallel_config.pipeline_parallel_size
    schedulers = [Scheduler(config.scheduler_config, cache, num_blocks, config.speculative_config,
                            max_loras=lora.max_loras if lora else None,
                            batch_queue_size=pp if pp > 1 else None)
                  for _ in range(dp_size)]
    loaded = sharded.loaded
    core = EngineCore(config, runner, schedulers, loaded.tokenizer if detokenize else None,
                      set(loaded.eos_token_ids), loaded.args.vocab_size, num_blocks, proposer)
    if not config.runner_config.enforce_eager:
        runner.warmup(progress=log)
    # As vLLM: what start-up allocated leaves the collector's generations, so a full collection
    # while serving scans only what serving allocates (a long one stalls the step pipeline).
    gc.collect()
    gc.freeze()
    return core


def _draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft's engine: the target's settings with the draft model, greedy proposals only
    (no speculation of its own, no LoRA), scheduled synchronously (a round needs its tokens),
    prefix caching on whatever the target's (each round re-proposes over the request's tokens;
    the draft's cache is private, so caching changes no output)."""
    return replace(config, model_config=config.speculative_config.draft_model_config,
                   speculative_config=None, lora_config=None,
                   cache_config=replace(config.cache_config, enable_prefix_caching=True),
                   runner_config=replace(config.runner_config, async_scheduling=False))


def _load_draft(config: EngineConfig, log) -> tuple[EngineConfig, ShardedModel] | None:
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    draft_config = _draft_engine_config(config)
    log(f"Draft model for speculative decoding: {spec.model}")
    return draft_config, load_for_engine(draft_config, None)


def _load_eagle(config: EngineConfig, sharded: ShardedModel, log):
    """(EagleArgs, params) of an EAGLE / EAGLE-3 head, or None; binds EAGLE-3's feature
    layers into the target's forward."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("eagle", "eagle3"):
        return None
    head = read_eagle_args(spec.model, spec.method, sharded.args)
    log(f"{spec.method} head for speculative decoding: {spec.model}")
    params = load_eagle_head(spec.model, head, jax.tree.leaves(sharded.loaded.params)[0].dtype)
    if head.eagle3:
        sharded.model_fn = partial(sharded.model_fn, aux_layers=head.aux_layers)
    return head, params


def _eagle_block_bytes(config: EngineConfig, sharded: ShardedModel) -> int:
    """The head's one layer of KV per block (in the model's dtype)."""
    if sharded.eagle is None:
        return 0
    head, params = sharded.eagle
    return kv_cache.bytes_per_block(1, config.cache_config.block_size, head.layer.num_kv_heads,
                                    head.layer.head_dim, params["fc"].dtype)


def _make_drafter(config: EngineConfig, sharded: ShardedModel, num_blocks: int):
    if sharded.eagle is None:
        return None
    head, params = sharded.eagle
    block_size = config.cache_config.block_size
    cache = kv_cache.allocate_kv_caches(1, num_blocks, block_size, head.layer.num_kv_heads,
                                        head.layer.head_dim, params["fc"].dtype)[0]
    attn, _ = attention_backend(config.runner_config.attention_backend)
    return EagleDrafter(head, params, cache, config.speculative_config.num_speculative_tokens,
                        attn, block_size)


def _make_proposer(config: EngineConfig, draft: tuple[EngineConfig, ShardedModel] | None,
                   num_blocks: int, log) -> Proposer | None:
    """The host-side proposer (n-gram, draft model); None without one (EAGLE drafts inside
    the runner)."""
    spec = config.speculative_config
    if spec is None or spec.method in ("eagle", "eagle3"):
        return None
    if draft is None:
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max, config.model_config.max_model_len)
    # The draft engine detokenises nothing: its tokens only become drafts.
    core = _assemble_core(*draft, 1, num_blocks, log, detokenize=False)
    return DraftModelProposer(core, spec.num_speculative_tokens)


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
                       drafter=_make_drafter(config, sharded, dp_size * num_blocks))


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

