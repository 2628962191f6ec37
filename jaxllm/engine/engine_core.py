"""EngineCore: one engine iteration is schedule -> jitted step -> scheduler update -> outputs.

With async scheduling an iteration launches step N+1 before it fetches step N's tokens, so the
device runs N+1 while the host updates the scheduler and detokenises N; the scheduler's
placeholders stand for the tokens in flight. Blocks freed by N's results (finished requests,
including a stop string found now) are safe to hand out: only steps launched later can write
them, and the device runs steps in launch order.
"""

from __future__ import annotations

import copy
import functools
import logging
import os

import jax
import numpy as np

from jaxllm.core.dp_scheduler import DPScheduler
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler, SchedulerOutput
from jaxllm.engine.args import EngineArgs
from jaxllm.engine.output_processor import OutputProcessor, child_request_id
from jaxllm.outputs import RequestOutput
from jaxllm.sample.metadata import check_min_tokens_stop_ids
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker import kv_cache
from jaxllm.worker.model_runner import LaunchedStep, ModelRunner
from pallas_kernels import kv_write, ragged_paged_attention
from jaxllm.engine.model_setup import engine_mesh, load_for_engine

logger = logging.getLogger("jaxllm")


def _attention_backend(name: str):
    """-> (attention, KV write). pallas: the Triton kernel, and the Mosaic GPU one for prefill
    buckets on Hopper; triton / mosaic: that kernel for every bucket; xla: the jnp reference."""
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" else "xla"
    if name == "xla":
        return ragged_paged_attention.ragged_paged_attention_reference, kv_write.write_kv_reference
    implementation = None if name == "pallas" else name
    return (functools.partial(ragged_paged_attention.ragged_paged_attention,
                              implementation=implementation), kv_write.write_kv)


def _enable_compilation_cache(path: str | None) -> None:
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class EngineCore:
    def __init__(self, engine_args: EngineArgs, log=logger.info, mesh=None) -> None:
        _enable_compilation_cache(engine_args.compilation_cache_dir)
        attn, write_kv = _attention_backend(engine_args.attention_backend)
        # TP (and EP within it) runs on `mesh`; DP replicas each get their own (dp_engine.py).
        # A mesh with DP > 1 rows is DP attention: one scheduler and KV pool per rank, one step.
        mesh = mesh if mesh is not None else engine_mesh(engine_args)
        self.dp_size = 1 if mesh is None else mesh.shape["data"]
        sharded = load_for_engine(engine_args, mesh, attn, write_kv)
        loaded = sharded.loaded
        self.config = config = engine_args.create_engine_config(loaded.max_model_len)
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.vocab_size = loaded.args.vocab_size
        self.max_model_len = config.scheduler_config.max_model_len
        self.model_name = (engine_args.served_model_name or engine_args.model
                           or "SmolLM2-135M-Instruct")
        self._seed_rng = np.random.default_rng(engine_args.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

        model_fn = sharded.model_fn
        cache_config, sched = config.cache_config, config.scheduler_config
        args = sharded.args  # KV heads as the cache holds them
        # Per device: the cache is split by KV head over the TP devices.
        layout = (args.num_layers, cache_config.block_size, args.num_kv_heads // sharded.tp,
                  args.head_dim)
        dtype = jax.tree.leaves(loaded.params)[0].dtype
        block_bytes = kv_cache.bytes_per_block(*layout, dtype)

        def make_runner(num_blocks: int) -> ModelRunner:
            caches = kv_cache.allocate_kv_caches(args.num_layers, self.dp_size * num_blocks,
                                                 cache_config.block_size, args.num_kv_heads,
                                                 args.head_dim, dtype,
                                                 sharded.kv_cache_sharding)
            return ModelRunner(model_fn, loaded.params, caches, vocab_size=args.vocab_size,
                               block_size=cache_config.block_size,
                               max_model_len=self.max_model_len,
                               max_num_seqs=sched.max_num_seqs,
                               max_num_batched_tokens=sched.max_num_batched_tokens,
                               dp_size=self.dp_size,
                               lean_steps=config.runner_config.lean_steps)

        self.num_blocks = cache_config.num_gpu_blocks_override
        if self.num_blocks is None:
            self.num_blocks = self._measure_num_blocks(make_runner, block_bytes)
        kv_cache.check_fits(self.num_blocks, cache_config.block_size, self.max_model_len,
                            block_bytes)
        log(f"KV cache: {self.num_blocks} blocks of {cache_config.block_size} tokens "
            f"({self.num_blocks * block_bytes / kv_cache.GiB:.2f} GiB)"
            + (f" per DP rank, {self.dp_size} ranks" if self.dp_size > 1 else ""))
        self.runner = make_runner(self.num_blocks)
        self.scheduler_ranks = [Scheduler(sched, cache_config, self.num_blocks)
                                for _ in range(self.dp_size)]
        self.scheduler = (self.scheduler_ranks[0] if self.dp_size == 1
                          else DPScheduler(self.scheduler_ranks))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.async_scheduling = config.runner_config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        if not config.runner_config.enforce_eager:
            self.runner.warmup(progress=log)

    def _measure_num_blocks(self, make_runner, block_bytes: int) -> int:
        cache_config = self.config.cache_config
        if kv_cache.device_memory_limit() is None:  # CPU: a fixed budget, nothing to profile
            return max(cache_config.cpu_kv_cache_bytes // block_bytes, 0)
        probe = make_runner(2)
        available = kv_cache.device_memory_available(cache_config.gpu_memory_utilization,
                                                     probe.activation_bytes())
        del probe
        return max(int(available // block_bytes), 0)

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, prompt: str | None = None) -> None:
        self._validate(request_id, prompt_token_ids)
        n = sampling_params.n
        children = []
        for index in range(n):
            params = copy.copy(sampling_params)
            params.n = 1
            params.all_stop_token_ids = set() if params.ignore_eos else set(self.eos_token_ids)
            check_min_tokens_stop_ids(params)
            # Every request gets a concrete seed: its samples then depend only on (seed, step).
            params.seed = (int(self._seed_rng.integers(0, 2**31 - 1)) if params.seed is None
                           else (params.seed + index) & 0x7FFFFFFF)
            children.append(Request(child_request_id(request_id, index, n), prompt_token_ids,
                                    params))
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)  # may refuse (e.g. more blocks than the pool)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        self.output_processor.add_request(request_id, prompt, list(prompt_token_ids), children)
        self.prompt_tokens_total += len(prompt_token_ids)

    def _validate(self, request_id: str, prompt_token_ids: list[int]) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if len(prompt_token_ids) == 0:
            raise ValueError("The decoder prompt cannot be empty.")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                f"model length of {self.max_model_len}. Make sure that `max_model_len` is no "
                f"smaller than the number of text tokens.")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary (vocab_size="
                             f"{self.vocab_size}).")

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            child_ids = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- one iteration --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, then returns the outputs of the step it collects: this
        one, or with async scheduling the one launched by the previous call."""
        scheduler_output = self.scheduler.schedule()
        launched = None
        if scheduler_output.num_reqs:
            launched = (scheduler_output, self.runner.launch(scheduler_output))
        else:
            self.runner.release(scheduler_output.finished_req_ids
                                | scheduler_output.preempted_req_ids)
        if self.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        return self._process(*launched) if launched else []

    def _process(self, scheduler_output: SchedulerOutput,
                 launched: LaunchedStep) -> list[RequestOutput]:
        """Fetches a step's tokens and turns them into scheduler updates and outputs."""
        result = self.runner.collect(launched)
        if result.prompt_logprobs:
            self.output_processor.record_prompt_logprobs(result.prompt_logprobs)
        updated = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids)
        self.generation_tokens_total += sum(map(len, result.sampled_token_ids.values()))
        outputs, stopped = self.output_processor.process(updated, result.logprobs)
        if stopped:
            self.scheduler.finish_requests([r.request_id for r in stopped],
                                           RequestStatus.FINISHED_STOPPED)
        return outputs

    def get_stats(self) -> dict:
        stats = self.scheduler.make_stats()
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage,
                "num_preemptions_total": stats.num_preemptions_total,
                "num_free_blocks": sum(s.kv_cache_manager.num_free_blocks
                                       for s in self.scheduler_ranks),
                "num_blocks": self.num_blocks * self.dp_size,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total}
