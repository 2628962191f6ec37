"""The scheduler, vLLM V1 style: one token budget per step, granted running requests first.

Every request has `num_computed_tokens`; a step grants each request min(its uncomputed tokens,
the budget left) tokens, so a prefill that does not fit is simply chunked and decode is a grant
of one. Running requests are served in order, then waiting ones first-come first-served between
parent requests, taking turns between the n > 1 children of each (waiting_queue.py). When
the pool runs out of blocks for a running request, the newest running request is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue with
num_computed_tokens = 0 (its prompt is now all its tokens so far).

Prefix caching (kv_cache_manager.py): a request being admitted (or resumed) starts at the
longest cached run of its full blocks, so its NewRequestData has num_computed_tokens > 0 and the
grant covers only the rest; a preempted request finds its own freed blocks again if they were
not reused meanwhile.

The step contract (SchedulerOutput): a request the runner does not hold yet (admitted, or
resumed after preemption) comes once as NewRequestData with everything the runner needs; a
continuing one as CachedRequestData with only its new block ids and num_computed_tokens. The
runner keeps each request's tokens itself and returns a list of sampled tokens per request (one,
or with draft tokens to verify, the accepted ones and a bonus token).

Async scheduling (vLLM's num_output_placeholders): a grant that samples leaves one placeholder
on the request until update_from_output() brings the token. The engine may call schedule() for
step N+1 before step N's tokens are in: a request whose last token is such a placeholder is then
granted it as its next decode token, with token id PLACEHOLDER_TOKEN_ID, which the runner
replaces on device with the token step N sampled. The next schedule() must come after step N's
update (the engine's order), so every grant holds at most one placeholder, and a preempted
request is recomputed from real tokens only. A request that will end by length once its
placeholder resolves gets no further grant; one that ends on a stop token wastes one.

Speculative decoding (vLLM's spec_token_ids): a running request whose grant samples from known
tokens also gets its draft tokens (update_draft_token_ids), within the token budget, max_model_len
and max_tokens, and blocks for them. update_from_output rolls num_computed_tokens back over the
rejected drafts, so the next step rewrites their KV slots in place (no copy; the blocks stay the
request's). No drafts are granted in a step whose running batch reaches disable_by_batch_size.
The engine never combines drafts with async scheduling (EngineArgs).

Batch queue (pipeline parallelism, vLLM's batch queue): the engine keeps up to
batch_queue_size steps in flight, so schedule() runs several times before the oldest step's
update. A request whose last token is still in flight then gets no grant until it arrives (no
placeholder inputs: the pipeline's first stage cannot read what its last stage samples without
waiting for it), while prefill chunks keep flowing (each stage writes a chunk's KV before the
next chunk reads it: one stage's programs run in launch order). Each step takes at most
max_num_seqs / batch_queue_size (rounded up) sequences, so the batches in flight share the
running requests and every stage has work.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.spec_decode_stats import SpecDecodingStats
from jaxllm.core.waiting_queue import WaitingQueue
from jaxllm.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = -1  # a token sampled by a step still in flight (the runner fills it in)


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for (newly admitted, or resumed after preemption): all
    it needs, sent once."""
    request_id: str
    prompt_token_ids: array  # C ints, as the Request's
    output_token_ids: array  # known outputs: a resumed request recomputes them
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table
    num_computed_tokens: int  # tokens already in the KV cache before this step
    lora_request: object = None  # its LoRA adapter (jaxllm.lora.LoRARequest), or None


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since its last step."""
    request_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int  # before this step


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work, vLLM V1's contract. Batch order: cached requests, then new ones."""
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # per request, draft tokens included
    total_num_scheduled_tokens: int
    # Draft tokens to verify, per request that has any: they follow its last token in the step.
    scheduled_spec_decode_tokens: dict[str, list[int]]
    finished_req_ids: set[str]  # finished or aborted since the previous schedule()
    preempted_req_ids: set[str]

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled_new_reqs) + len(self.scheduled_cached_reqs)

    @property
    def req_ids(self) -> list[str]:
        """The scheduled requests in batch order."""
        return ([r.request_id for r in self.scheduled_cached_reqs]
                + [r.request_id for r in self.scheduled_new_reqs])


@dataclass(slots=True)
class _StepPlan:
    """What schedule() has granted so far in one step."""
    budget: int  # tokens left
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    grants: list["_Grant"] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Grant:
    """The scheduler's own record of a grant, kept until the step's results come back. It holds
    the request object, so a late token never reaches a later request that reuses the id."""
    request: Request
    samples: bool  # the grant reaches the last known token, so the step yields new ones
    num_drafts: int = 0  # draft tokens to verify after it


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks in use
    num_preemptions_total: int
    prefix_cache_queries_total: int = 0  # tokens of admitted requests looked up
    prefix_cache_hits_total: int = 0  # of those, tokens found cached
    spec_decoding: SpecDecodingStats | None = None  # cumulative, with speculative decoding
    # With LoRA: the adapters' names among the running and the waiting requests (vLLM's
    # lora_requests_info)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_gpu_blocks: int,
                 speculative_config: SpeculativeConfig | None = None,
                 max_loras: int | None = None,
                 batch_queue_size: int | None = None) -> None:
        """max_loras (LoRA enabled): the running requests use at most this many adapters.
        batch_queue_size: steps the engine keeps in flight (pipeline parallelism); None: at
        most two, the second taking the first's tokens as placeholders (async scheduling)."""
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.placeholder_inputs = batch_queue_size is None
        self.max_seqs_per_step = -(-self.max_num_seqs // (batch_queue_size or 1))
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.kv_cache_manager = KVCacheManager(num_gpu_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               cache_config.prefix_caching_hash_algo)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # oldest admission first; preemption takes the last
        self.finished_req_ids: set[str] = set()  # since the previous schedule()
        self._step_id = 0
        self._grants: dict[int, list[_Grant]] = {}  # step id -> its grants, until its results
        # Ids of finished requests -> the newest step in flight that may hold them: a new
        # request under such an id waits for it, so an id names one request in the steps in
        # flight (the runner and the drafts are keyed by id).
        self._finished_in_flight: dict[str, int] = {}
        self.num_preemptions_total = 0
        self.speculative_config = speculative_config
        self.max_loras = max_loras
        self.spec_stats = (SpecDecodingStats(speculative_config.num_speculative_tokens)
                           if speculative_config else None)

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self._check_fits(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finished_id_in_flight(self, request_id: str) -> bool:
        """Whether a step in flight may hold a finished request of this id."""
        return request_id in self._finished_in_flight

    def _check_fits(self, request: Request) -> None:
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("The prompt cannot be empty.")
        if num_prompt > self.max_model_len:
            raise ValueError(f"The prompt (length {num_prompt}) is longer than the maximum model "
                             f"length of {self.max_model_len}.")
        # Else a request that cannot fit even alone would preempt itself forever.
        max_tokens = request.sampling_params.max_tokens or self.max_model_len
        max_kv_len = max(num_prompt, min(self.max_model_len, num_prompt + max_tokens) - 1)
        num_blocks = -(-max_kv_len // self.block_size)
        if num_blocks > self.num_gpu_blocks - 1:
            raise ValueError(
                f"Request {request.request_id!r} needs {num_blocks} KV cache blocks at its maximum "
                f"length of {max_kv_len} tokens, more than the {self.num_gpu_blocks - 1} usable "
                "blocks of the pool. Lower max_tokens or max_model_len, or give the KV cache more "
                "memory.")

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finishes requests from outside (abort, stop string); unknown or finished ids are
        ignored. Their blocks are freed at once."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a finished status, got {finished_status!r}.")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        """Its tokens still in flight are void: their step's blocks go back to the pool, which is
        safe because only steps launched later can write them."""
        request.num_output_placeholders = 0
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)
        if self._grants:
            self._finished_in_flight[request.request_id] = max(self._grants)

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        step = _StepPlan(self.max_num_batched_tokens)
        self._schedule_running(step)
        # As vLLM: no admissions in a step that had to preempt (the pool is full).
        if not step.preempted_ids:
            self._schedule_waiting(step)
        finished_ids, self.finished_req_ids = self.finished_req_ids, set()
        self._step_id += 1
        if step.grants:
            self._grants[self._step_id] = step.grants
        return SchedulerOutput(self._step_id, step.new_reqs, step.cached_reqs,
                               step.num_scheduled, self.max_num_batched_tokens - step.budget,
                               step.spec_tokens, finished_ids, step.preempted_ids)

    def _schedule_running(self, step: "_StepPlan") -> None:
        """Running requests first, in order, each with its drafts when speculating; one that
        needs blocks preempts the newest."""
        use_drafts = self.speculation_on()
        allocate_slots = self.kv_cache_manager.allocate_slots
        running = self.running
        req_index = 0
        while (req_index < len(running) and step.budget > 0
               and len(step.grants) < self.max_seqs_per_step):
            request = running[req_index]
            num_new_tokens = self._num_new_tokens(request, step.budget)
            if num_new_tokens <= 0:  # nothing to compute until its sampled token arrives
                req_index += 1
                continue
            drafts = self._drafts(request, num_new_tokens, step.budget) if use_drafts else []
            num_tokens = num_new_tokens + len(drafts)
            new_block_ids = allocate_slots(request, num_tokens)
            if new_block_ids is None:
                new_block_ids = self._preempt_until_fits(request, num_tokens, step.preempted_ids)
                if new_block_ids is None:
                    break
            step.cached_reqs.append(CachedRequestData(request.request_id, new_block_ids,
                                                      request.num_computed_tokens))
            step.grants.append(self._grant(request, num_new_tokens, step.num_scheduled, drafts))
            if drafts:
                step.spec_tokens[request.request_id] = drafts
            step.budget -= num_tokens
            req_index += 1

    def _schedule_waiting(self, step: "_StepPlan") -> None:
        """Then waiting requests in the queue's order, with their cached prefixes; one whose
        LoRA adapter would exceed max_loras among the running waits, with its siblings (they
        share it), and later ones go (as vLLM)."""
        loras = ({r.lora_int_id for r in self.running} - {0}
                 if self.max_loras is not None and self.waiting else set())
        skipped = []
        while (self.waiting and step.budget > 0 and len(self.running) < self.max_num_seqs
               and len(step.grants) < self.max_seqs_per_step):
            request = self.waiting.first()
            if request.num_output_placeholders:  # preempted with a token in flight: recompute
                break  # only once that token is known (after update_from_output)
            if self.finished_id_in_flight(request.request_id):  # its id's old steps first
                break
            lora = request.lora_int_id
            if lora and lora not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft_group())
                continue
            num_new_tokens = self._admit(request, step.budget)
            if num_new_tokens is None:
                break
            self.waiting.popleft()
            if lora:
                loras.add(lora)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.new_reqs.append(NewRequestData(
                request.request_id, request.prompt_token_ids, request.output_token_ids[:],
                request.sampling_params,
                list(self.kv_cache_manager.get_block_ids(request.request_id)),
                request.num_computed_tokens, request.lora_request))
            step.grants.append(self._grant(request, num_new_tokens, step.num_scheduled))
            step.budget -= num_new_tokens
        self.waiting.extendleft_groups(skipped)

    def _admit(self, request: Request, token_budget: int) -> int | None:
        """Gives a waiting request its cached prefix blocks and the blocks of its first grant;
        returns the grant's size, or None, changing nothing, when the pool cannot hold them."""
        kv = self.kv_cache_manager
        computed_blocks, num_cached = kv.get_computed_blocks(request)
        num_new_tokens = self._num_new_tokens(request, token_budget, num_cached)
        if kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
            return None
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
            kv.record_admission(request, num_cached)
        return num_new_tokens

    def _num_new_tokens(self, request: Request, token_budget: int,
                        num_computed: int | None = None) -> int:
        num_placeholders = request.num_output_placeholders
        num_tokens = len(request.all_token_ids) + num_placeholders
        if num_placeholders and (not self.placeholder_inputs or self._length_capped(
                num_tokens, len(request.output_token_ids) + num_placeholders, request)):
            return 0  # its token in flight is its next input, or its last whatever its id
        if num_computed is None:
            num_computed = request.num_computed_tokens
        return min(num_tokens - num_computed, token_budget, self.max_model_len - num_computed)

    def speculation_on(self) -> bool:
        """Whether this step may verify drafts: speculation is configured and the running batch
        is below disable_by_batch_size (a large batch is compute-bound, where verifying costs
        more than it saves)."""
        config = self.speculative_config
        return config is not None and len(self.running) < config.disable_by_batch_size

    def _drafts(self, request: Request, num_new_tokens: int, token_budget: int) -> list[int]:
        """The request's drafts that fit after a grant of num_new_tokens: only a grant that
        samples from known tokens, and only as many as the budget left, max_model_len and
        max_tokens allow (the step yields up to one token more than its drafts)."""
        if (not request.spec_token_ids or request.num_output_placeholders
                or request.num_computed_tokens + num_new_tokens != request.num_tokens):
            return []
        room = min(token_budget - num_new_tokens, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[:max(room, 0)]

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Sets the drafts proposed for requests (after their tokens of the last step)."""
        for request_id, drafts in draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = drafts

    def _length_capped(self, num_tokens: int, num_output_tokens: int, request: Request) -> bool:
        max_tokens = request.sampling_params.max_tokens
        return (num_tokens >= self.max_model_len
                or (max_tokens is not None and num_output_tokens >= max_tokens))

    def _preempt_until_fits(self, request: Request, num_new_tokens: int,
                            preempted_ids: set[str]) -> list[int] | None:
        """Preempts the newest running requests until the grant's blocks fit; returns the new
        block ids, or None when the request itself had to be preempted."""
        new_block_ids = None
        while new_block_ids is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted_ids.add(victim.request_id)
            if victim is request:
                return None
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
        return new_block_ids

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _grant(self, request: Request, num_new_tokens: int, num_scheduled: dict[str, int],
               drafts: list[int] = ()) -> _Grant:
        """Records the grant and advances num_computed_tokens past it and its drafts (as
        vLLM); a grant that samples adds a placeholder for its token."""
        num_scheduled[request.request_id] = num_new_tokens + len(drafts)
        request.num_computed_tokens += num_new_tokens
        samples = (request.num_computed_tokens
                   == len(request.all_token_ids) + request.num_output_placeholders)
        request.num_computed_tokens += len(drafts)
        request.num_output_placeholders += samples
        request.spec_token_ids = []  # used, or stale once this grant's tokens are in
        return _Grant(request, samples, len(drafts))

    # ---- results ----

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        """Replaces each sampling request's oldest placeholder with its new tokens and finishes
        those that hit a stop; returns the requests that got tokens, finished ones included.
        A request preempted after this step was launched still gets its tokens."""
        updated: list[Request] = []
        any_finished = False
        if self._finished_in_flight:
            self._finished_in_flight = {i: s for i, s in self._finished_in_flight.items()
                                        if s > scheduler_output.step_id}
        for grant in self._grants.pop(scheduler_output.step_id, ()):
            request = grant.request
            if not grant.samples or request.is_finished():  # finished or aborted meanwhile
                continue
            request.num_output_placeholders -= 1
            was_preempted = request.status == RequestStatus.PREEMPTED
            token_ids = sampled_token_ids[request.request_id]
            if grant.num_drafts:
                self._reject_drafts(request, grant.num_drafts, len(token_ids) - 1)
            stopped = False
            for token_id in token_ids:
                request.append_output_token_id(token_id)
                stopped = self._check_stop(request)
                if stopped:
                    break
            if stopped:
                if was_preempted:
                    self.waiting.remove(request)
                self._free_request(request)
                any_finished = True
            updated.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return updated

    def _reject_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Counts the verification and rolls num_computed_tokens back over the rejected drafts:
        their KV slots are rewritten by the next step."""
        self.spec_stats.observe(num_drafts, num_accepted)
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted

    def _check_stop(self, request: Request) -> bool:
        """Sets a finished status when the request's last token ends it (vLLM's check_stop)."""
        params = request.sampling_params
        if self._length_capped(request.num_tokens, request.num_output_tokens, request):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_output_tokens < params.min_tokens:
            return False
        last_token_id = request.output_token_ids[-1]
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        if not params.ignore_eos and last_token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    # ---- state ----

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (nothing changes) while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(len(self.running), len(self.waiting), kv.usage,
                              self.num_preemptions_total, kv.stats.queries, kv.stats.hits,
                              self.spec_stats,
                              *((_lora_names(self.running), _lora_names(self.waiting))
                                if self.max_loras is not None else ()))


def _lora_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request}))
