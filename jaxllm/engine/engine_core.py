"""EngineCore: one engine iteration is schedule -> jitted step -> scheduler update -> outputs.

With async scheduling an iteration launches step N+1 before it fetches step N's tokens, so the
device runs N+1 while the host updates the scheduler and detokenises N; the scheduler's
placeholders stand for the tokens in flight. Blocks freed by N's results (finished requests,
including a stop string found now) are safe to hand out: only steps launched later can write
them, and the device runs steps in launch order.

With pipeline parallelism the engine keeps up to PP steps in flight (vLLM's batch queue), so
that while the last stage runs one batch the first runs the next; the scheduler then holds back
a request until its token in flight arrives (core/scheduler.py) instead of using placeholders.
"""

from __future__ import annotations

import bisect
import copy
import itertools
import logging
from collections import deque

import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.core.dp_scheduler import DPScheduler
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler, SchedulerOutput
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.engine.lora_admin import LoRAAdmin
from jaxllm.engine.output_processor import OutputProcessor, child_request_id
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import RequestOutput
from jaxllm.sample.metadata import check_min_tokens_stop_ids
from jaxllm.sampling_params import SamplingParams
from jaxllm.spec_decode.proposer import Proposer
from jaxllm.worker.model_runner import LaunchedStep, ModelRunner

logger = logging.getLogger("jaxllm")

# vLLM's buckets of its iteration_tokens_total histogram (tokens scheduled in one step).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineCore(LoRAAdmin):
    """Built by jaxllm/engine/builder.py: the model loaded, the KV cache sized, warmed up."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, schedulers: list[Scheduler],
                 tokenizer, eos_token_ids: set[int], vocab_size: int, num_blocks: int,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.runner = runner
        self.scheduler_ranks = schedulers  # one per DP rank (DP attention), else one
        self.scheduler = schedulers[0] if len(schedulers) == 1 else DPScheduler(schedulers)
        self.dp_size = len(schedulers)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks  # per DP rank
        self.max_model_len = config.model_config.max_model_len
        self.model_name = config.model_config.served_model_name
        self.async_scheduling = config.runner_config.async_scheduling
        self.output_processor = OutputProcessor(tokenizer)
        # Token ids only: the model's vocabulary bounds them (random-id benchmarks may use ids
        # past a smaller tokenizer's).
        self.input_processor = InputProcessor(None, self.max_model_len, vocab_size)
        self._seed_rng = np.random.default_rng(config.model_config.seed)
        self._in_flight: deque[tuple[SchedulerOutput, LaunchedStep]] = deque()
        self.max_in_flight = max_steps_in_flight(config)
        self._share_groups = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Steps by tokens scheduled, per ITERATION_TOKENS_BUCKETS upper bound (and one over all).
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.proposer = proposer  # drafts with speculative decoding

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, prompt: str | None = None,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """cache_salt: requests share cached KV only with requests of the same salt.
        lora_request: the adapter to run the request with (loaded into host memory now, so a
        bad one is refused here)."""
        self._validate(request_id, prompt_token_ids, cache_salt)
        if lora_request is not None:
            self.add_lora(lora_request)
        n = sampling_params.n
        # n > 1 children share their prompt's blocks: with caching on as any requests do, with
        # it off through a key of their own.
        share_group = (next(self._share_groups)
                       if n > 1 and not self.config.cache_config.enable_prefix_caching else None)
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
                                    params, cache_salt=cache_salt, share_group=share_group,
                                    lora_request=lora_request, parent_request_id=request_id))
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)  # may refuse (e.g. more blocks than the pool)
                added.append(child.request_id)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        # the children's prompt array, shared: nothing writes to a prompt
        self.output_processor.add_request(request_id, prompt, children[0].prompt_token_ids,
                                          children)
        self.prompt_tokens_total += len(prompt_token_ids)

    def _validate(self, request_id: str, prompt_token_ids: list[int],
                  cache_salt: str | None) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        self.input_processor.process(prompt_token_ids)  # the checks LLM and the server ran

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            child_ids = self.output_processor.child_ids(request_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (every DP rank's); False, changing nothing, while any
        request holds KV blocks (vLLM's semantics)."""
        if any(s.kv_cache_manager.num_free_blocks != self.num_blocks - 1
               for s in self.scheduler_ranks):
            return False
        return all([s.reset_prefix_cache() for s in self.scheduler_ranks])

    # -- one iteration --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step, then returns the outputs of the oldest step in flight
        once max_in_flight steps are (or nothing new was launched): this one without async
        scheduling, else one launched by an earlier call."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.num_reqs:
            self._in_flight.append((scheduler_output, self.runner.launch(scheduler_output)))
            self._count_iteration(scheduler_output.total_num_scheduled_tokens)
        else:
            self.runner.release(scheduler_output.finished_req_ids
                                | scheduler_output.preempted_req_ids)
        limit = self._steps_in_flight(scheduler_output)
        if self._in_flight and (len(self._in_flight) >= limit or not scheduler_output.num_reqs):
            outputs = self._process(*self._in_flight.popleft())
            while len(self._in_flight) >= limit:  # speculation resumes: run synchronously
                outputs += self._process(*self._in_flight.popleft())
            return outputs
        return []

    def _steps_in_flight(self, scheduler_output: SchedulerOutput) -> int:
        """max_in_flight, but one while speculating: a step that verifies drafts must finish
        before the next is scheduled (which positions exist depends on what it accepts), and
        drafts are proposed from a step's tokens. So a speculating engine runs synchronously
        while its batch is small and asynchronously once disable_by_batch_size turns
        speculation off (a large batch gains most from overlapping the host's work)."""
        if self.config.speculative_config is not None and (
                scheduler_output.scheduled_spec_decode_tokens or self.scheduler.speculation_on()):
            return 1
        return self.max_in_flight

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
        if self.proposer is not None or result.draft_token_ids is not None:
            self._propose_drafts(updated, result.draft_token_ids)
        return outputs

    def _propose_drafts(self, updated, step_drafts: dict[str, list[int]] | None) -> None:
        """Drafts for the requests that got tokens, to verify in the next step (none while the
        batch is too large for speculation to pay): the step's own (a drafter's, on device
        after each step), else the proposer's."""
        if not self.scheduler.speculation_on():
            return
        if step_drafts is None:
            step_drafts = self.proposer.propose_batch(
                {r.request_id: r.all_token_ids for r in updated if not r.is_finished()})
        self.scheduler.update_draft_token_ids(step_drafts)

    def _count_iteration(self, num_tokens: int) -> None:
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.iteration_tokens_sum += num_tokens

    def get_stats(self) -> dict:
        stats = self.scheduler.make_stats()
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "kv_cache_usage": stats.kv_cache_usage,
                "num_preemptions_total": stats.num_preemptions_total,
                "prefix_cache_queries_total": stats.prefix_cache_queries_total,
                "prefix_cache_hits_total": stats.prefix_cache_hits_total,
                "num_free_blocks": sum(s.kv_cache_manager.num_free_blocks
                                       for s in self.scheduler_ranks),
                "num_blocks": self.num_blocks * self.dp_size,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total,
                "iteration_tokens_counts": list(self.iteration_tokens_counts),
                "iteration_tokens_sum": self.iteration_tokens_sum,
                **_spec_decode_stats(stats.spec_decoding), **self._lora_stats(stats)}

    def _lora_stats(self, stats) -> dict:
        """vLLM's lora_requests_info labels (absent without LoRA)."""
        lora = self.config.lora_config
        if lora is None:
            return {}
        return {"lora_max": lora.max_loras, "lora_running": stats.running_lora_adapters,
                "lora_waiting": stats.waiting_lora_adapters}


def max_steps_in_flight(config: EngineConfig) -> int:
    """One step without async scheduling, two with it; with pipeline parallelism one per stage
    (vLLM's batch queue), so every stage has a batch."""
    pp = config.parallel_config.pipeline_parallel_size
    if pp > 1:
        return pp
    return 2 if config.runner_config.async_scheduling else 1


def _spec_decode_stats(stats) -> dict:
    """vLLM's spec_decode_* counters (absent without speculative decoding)."""
    if stats is None:
        return {}
    return {"spec_decode_num_drafts_total": stats.num_drafts,
            "spec_decode_num_draft_tokens_total": stats.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": stats.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos)}
