"""The model runner: one jitted step (worker/step.py) per engine iteration over a fixed-bucket
ragged batch.

Host side it applies the SchedulerOutput to its per-request state (request_states.py), turns
the step's chunks into StepInputs (numpy only: an eager jnp op here would compile for every new
shape), launches the step with its StepState donated, and fetches the sampled tokens in one
device-to-host transfer.

launch() returns as soon as the step is dispatched (jax dispatch is asynchronous) and collect()
waits for its tokens, so async scheduling can launch step N+1 before collecting step N.

With DP attention (dp_size > 1, MoE with expert parallelism) one step serves every DP rank: each
rank's batch is padded to the busiest rank's bucket and the ranks are concatenated rank-major
(see _build_inputs); the sampler and penalty rows cover all ranks' sequences.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.core.dp_scheduler import DPSchedulerOutput
from jaxllm.core.scheduler import SchedulerOutput
from jaxllm.sample import sampler
from jaxllm.sample.sampler import SamplerStages
from jaxllm.worker import step as step_fn
from jaxllm.worker.batch import SeqChunk, build_step_batch
from jaxllm.worker.draft_rows import DraftRowBuilder
from jaxllm.worker.drafter import Drafter
from jaxllm.worker.lora_slots import LoRASlots
from jaxllm.worker.packing import pack
from jaxllm.worker.pipeline import Pipeline
from jaxllm.worker.request_states import RequestStates, ScheduledChunk
from jaxllm.worker.step import HistoryInputs, StepInputs, StepModel, StepOutput, StepState

logger = logging.getLogger(__name__)


def token_buckets(max_num_batched_tokens: int, min_bucket: int = 16) -> list[int]:
    """Powers of two up to the token budget, which closes the list."""
    buckets, size = [], min(min_bucket, max_num_batched_tokens)
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_num_batched_tokens]


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int, *, one_token: bool,
                 decode: bool) -> list[int]:
    """token_buckets, with below them, given one_token, a one-token bucket and, given decode, a
    bucket of max_num_seqs tokens where that is fewer than the smallest: a decode step of every
    sequence then fits a bucket no larger than its rows, which attention runs with its decode
    kernel (a larger bucket on so few rows may hold a prefill, and takes the prefill kernel)."""
    buckets = token_buckets(max_num_batched_tokens)
    below = {1} if one_token else set()
    if decode and max_num_seqs < buckets[0]:
        below.add(max_num_seqs)
    return sorted(below | set(buckets))


# (chosen token's logprob, its rank, top ids, top logprobs)
LogprobEntry = tuple[float, int, list[int], list[float]]


def _temp_bytes(analysis) -> int:
    return int(getattr(analysis, "temp_size_in_bytes", 0)) if analysis else 0


def _logprob_entry(tensors, row: int, num_top: int) -> LogprobEntry:
    return (float(tensors.sampled_logprob[row]), int(tensors.sampled_rank[row]),
            tensors.top_ids[row, :num_top].tolist(), tensors.top_logprobs[row, :num_top].tolist())


def _until_negative(values: np.ndarray) -> list[int]:
    ends = np.flatnonzero(values < 0)
    return values[:ends[0] if ends.size else len(values)].tolist()


@dataclass
class ModelRunnerOutput:
    # Per request that sampled: its new tokens (one; with draft tokens, the accepted ones and
    # a bonus token).
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[LogprobEntry]]  # one per sampled token, for requests that ask
    # request id -> [(prompt position scored, entry)], only for requests that ask
    prompt_logprobs: dict[str, list[tuple[int, LogprobEntry]]]
    # With a drafter: per request that sampled, the drafts to verify next (None: none ran)
    draft_token_ids: dict[str, list[int]] | None = None


@dataclass
class LaunchedStep:
    """A dispatched step whose results are still on device."""
    chunks: list[ScheduledChunk]  # DP ranks' chunks rank-major
    batch_rows: np.ndarray  # [len(chunks)] each request's sequence row in the batch
    token_starts: np.ndarray  # [len(chunks)] flat index of each request's first token
    want_prompt: list[int]  # indices into chunks of the requests that get prompt logprobs
    sampled: sampler.SamplerOutput  # on device
    prompt_logprobs: object  # LogprobsTensors on device, or None
    num_accepted: object = None  # [S] accepted drafts on device (speculative decoding)
    drafts: object = None  # [S, k] the drafter's drafts on device


@dataclass
class _RankInputs:
    """One DP rank's part of a step, before the ranks are concatenated."""
    inputs: StepInputs  # sampling metadata still unset
    chunks: list[ScheduledChunk]
    want_prompt: list[int]


def _placement(ranks: list[_RankInputs], num_tokens_padded: int, num_seqs_padded: int):
    """LaunchedStep's chunks, batch_rows, token_starts and want_prompt over the ranks,
    rank-major."""
    chunks, batch_rows, token_starts, want_prompt = [], [], [], []
    for rank, part in enumerate(ranks):
        num_seqs = len(part.chunks)
        batch_rows.append(rank * num_seqs_padded + np.arange(num_seqs))
        token_starts.append(rank * num_tokens_padded + part.inputs.batch.cu_q_lens[:num_seqs])
        want_prompt += [len(chunks) + i for i in part.want_prompt]
        chunks += part.chunks
    return chunks, np.concatenate(batch_rows), np.concatenate(token_starts), want_prompt


class ModelRunner:
    def __init__(self, model_fn: Callable, params, kv_caches, *, vocab_size: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 dp_size: int = 1, lean_steps: bool | None = None, num_spec_tokens: int = 0,
                 max_spec_seqs: int = 0, pipeline: Pipeline | None = None,
                 lora_slots: LoRASlots | None = None,
                 drafter: Drafter | None = None, one_token_bucket: bool = False,
                 decode_bucket: bool | None = None) -> None:
        """dp_size > 1: DP attention, one step for dp_size ranks (max_num_seqs each) whose
        SchedulerOutputs come in one DPSchedulerOutput; the KV cache holds every rank's pool.

        lean_steps (default: on a GPU): no lax.cond in any step. On a GPU every cond makes the
        host wait for the device to reach it (XLA reads the predicate back), which stalls async
        scheduling. Each bucket then has three programs: GREEDY (the argmax alone) for batches
        whose every row is greedy, PLAIN (no penalties, no top-k/top-p, no logprobs) for the
        other batches that use none of them, and ALL (every sampler stage for every row) for
        the rest; prompt logprobs run as a program of their own after the step, only when
        asked. Without lean steps one program per bucket runs each optional stage under a
        cond (COND), which is free on a CPU.

        num_spec_tokens > 0 (speculative decoding, one DP rank): steps verify up to that many
        draft tokens for up to max_spec_seqs sequences (worker/draft_rows.py).

        pipeline (pipeline parallelism): the stages before the last, run before each step;
        params, kv_caches and model_fn are then the last stage's (worker/pipeline.py).

        lora_slots (LoRA enabled, one DP rank, one stage): each token reads its request's
        adapter slot; the stacks ride in params["lora"].

        drafter (EAGLE, draft model): drafts on device after each step whose batch may
        speculate (fewer than max_spec_seqs + 1 sequences).

        one_token_bucket: a bucket of one token below the others, for a model whose step costs
        less with one row than with 16 (FP8 weights' GEMV, models/quant.py).

        decode_bucket (default: on a GPU, without a one-token bucket): with max_num_seqs under
        the smallest token bucket, a bucket of max_num_seqs tokens for decode steps
        (step_buckets). Engines with the quantised GEMV keep their one-token bucket alone: an
        FP8 step of 8 rows measured slower in an 8-token bucket than in the 16-token one (its
        GEMMs, not attention)."""
        self.pipeline = pipeline
        self.lora = lora_slots
        self.params = params if lora_slots is None else lora_slots.with_stacks(params)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.dp_size = dp_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = step_buckets(
            max_num_batched_tokens, max_num_seqs, one_token=one_token_bucket,
            decode=(jax.default_backend() == "gpu" and not one_token_bucket
                    if decode_bucket is None else decode_bucket))
        num_rows = dp_size * max_num_seqs  # penalty rows of every rank's sequences
        # Its own jit, so that tracing it once per bucket serves every program of the bucket.
        self.model = StepModel(jax.jit(model_fn, static_argnames=("return_hidden",)),
                               step_fn.vocab_split(params))
        # On a mesh the sampler runs replicated, so its state is replicated too; placed so from
        # the start, the second step does not recompile for a new sharding.
        mesh = self.model.mesh
        place = (lambda x: x) if mesh is None else partial(  # noqa: E731
            jax.device_put, device=NamedSharding(mesh, P()))
        self.state = StepState(kv_caches, place(sampler.init_penalty_state(num_rows, vocab_size)),
                               place(jnp.zeros(num_rows + 1, jnp.int32)))
        self.garbage_row = num_rows  # padding sequences and tokens use the last row
        self.requests = RequestStates(num_rows, self.max_blocks_per_seq)
        self.lean_steps = jax.default_backend() == "gpu" if lean_steps is None else lean_steps
        self._compiled: dict = {}  # (packed-input layout, stages) -> the step compiled for it
        self.draft_rows = (DraftRowBuilder(num_spec_tokens, min(max_spec_seqs, max_num_seqs),
                                           self.garbage_row) if num_spec_tokens else None)
        self.drafter = drafter
        self.max_spec_seqs = max_spec_seqs

    @property
    def kv_caches(self):
        return self.state.kv_caches

    @property
    def programs(self) -> tuple[SamplerStages, ...]:
        """The sampler stages each bucket is compiled with."""
        return ((SamplerStages.GREEDY, SamplerStages.PLAIN, SamplerStages.ALL)
                if self.lean_steps else (SamplerStages.COND,))

    def _lower(self, packed, layout, stages: SamplerStages):
        params = (self.params if self.pipeline is None
                  else self.pipeline.lowering_params(self.params, layout))
        return step_fn.step.lower(params, self.state, packed, model=self.model,
                                  layout=layout, stages=stages)

    def _run_step(self, inputs: StepInputs, stages: SamplerStages) -> StepOutput:
        """Runs the step on inputs, sent as one packed buffer, through the executable the
        warm-up compiled for it (else jit)."""
        packed, layout = pack(inputs)
        params = (self.params if self.pipeline is None
                  else self.pipeline.step_params(self.params, packed, layout))
        compiled = self._compiled.get((layout, stages))
        if compiled is not None:
            out, self.state = compiled(params, self.state, packed)
        else:
            out, self.state = step_fn.step(params, self.state, packed, model=self.model,
                                           layout=layout, stages=stages)
        return out

    def _dispatch(self, inputs: StepInputs, stages: SamplerStages) -> tuple[StepOutput, object]:
        """The step, then (programs without conds) prompt logprobs when asked: (StepOutput,
        prompt LogprobsTensors or None) on device."""
        out = self._run_step(inputs, stages)
        if stages == SamplerStages.COND:
            return out, out.prompt_logprobs
        return out, (step_fn.prompt_logprobs(self.params, out.hidden, inputs.next_prompt_ids,
                                             model=self.model)
                     if inputs.any_prompt_logprobs else None)

    def _draft(self, inputs: StepInputs, out: StepOutput, chunks: list[ScheduledChunk],
               first_rows: np.ndarray):
        """The drafter's drafts after a step (on device), or None: no drafter, or a batch too
        large to speculate (the scheduler grants no drafts then; the drafter's KV for this
        step's positions is then missing, which costs acceptance, not correctness)."""
        if self.drafter is None or len(chunks) > self.max_spec_seqs:
            return None
        rows = np.fromiter((c.state.row for c in chunks), np.int32, len(chunks))
        return self.drafter.launch(
            self.params, inputs, chunks, first_rows, self.requests.block_tables.num_blocks[rows],
            *self._draft_step_outputs(out))

    @staticmethod
    def _draft_step_outputs(out: StepOutput) -> tuple:
        """What the drafter reads of a step: its input tokens, features, sampled tokens and
        accepted counts."""
        return (out.token_ids, out.hidden if out.aux is None else out.aux, out.sampled.token_ids,
                out.num_accepted)

    def _stages_for(self, inputs: StepInputs, chunks: list[ScheduledChunk]) -> SamplerStages:
        """ALL when a sampling row uses top-k/top-p or logprobs, or when any scheduled request
        uses penalties, sampling or not: PLAIN neither resets penalty rows nor records tokens,
        and such a request needs both in every step it is in (its first resets its row, which
        another request may have left stale; each chunk of a long prompt counts). Else GREEDY
        when every row is greedy (the argmax alone), PLAIN otherwise."""
        if not self.lean_steps:
            return SamplerStages.COND
        md = inputs.sampling
        if (md.any_top_k_top_p or md.any_logprobs
                or any(c.state.uses_penalties for c in chunks)):
            return SamplerStages.ALL
        return SamplerStages.GREEDY if sampler.all_greedy(md) else SamplerStages.PLAIN

    def release(self, request_ids) -> None:
        """Drops the state of finished or preempted requests (a step with nothing scheduled)."""
        self.requests.release(request_ids)

    # -- one step -----------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> tuple[int, int]:
        num_tokens_padded = next(b for b in self.buckets if b >= num_tokens)
        return num_tokens_padded, min(num_tokens_padded, self.max_num_seqs)

    def launch(self, scheduler_output: SchedulerOutput | DPSchedulerOutput) -> LaunchedStep:
        """Applies the scheduler's output, builds the step's inputs and dispatches it; returns
        without waiting for the device."""
        rank_outputs = (scheduler_output.ranks if isinstance(scheduler_output, DPSchedulerOutput)
                        else [scheduler_output])
        rank_chunks = [self.requests.apply(out) for out in rank_outputs]
        if self.lora is not None:
            self._assign_lora_slots(scheduler_output)
        chunks = [c for rank in rank_chunks for c in rank]
        self._record_histories(chunks)
        num_tokens_padded, num_seqs_padded = self.bucket_for(
            max(out.total_num_scheduled_tokens for out in rank_outputs))
        inputs, placement = self._build_inputs(rank_chunks, num_tokens_padded, num_seqs_padded)
        out, prompt_logprobs = self._dispatch(inputs, self._stages_for(inputs, chunks))
        return LaunchedStep(*placement, out.sampled, prompt_logprobs, out.num_accepted,
                            self._draft(inputs, out, placement[0], placement[1]))

    def _assign_lora_slots(self, scheduler_output: SchedulerOutput) -> None:
        """Gives each new request the slot of its adapter, moving adapters in as needed."""
        states = self.requests.states
        busy = None
        for new in scheduler_output.scheduled_new_reqs:
            if new.lora_request is None:
                continue
            if busy is None:
                busy = {state.lora_slot for state in states.values()}
            slot = self.lora.slot_for(new.lora_request, busy)
            states[new.request_id].lora_slot = slot
            busy.add(slot)
        self.params = self.lora.with_stacks(self.params)

    def _record_histories(self, chunks: list[ScheduledChunk]) -> None:
        """A request admitted on a prefix cache hit starts past tokens no step computes for it;
        when it uses penalties its penalty row starts over here with them (prompt tokens mark
        the prompt mask, a resumed request's outputs count), and the step leaves the row be."""
        history = [c for c in chunks
                   if c.state.new and c.start and c.state.uses_penalties]
        if not history:
            return
        lengths = [c.start for c in history]
        token_ids = np.concatenate([c.state.token_ids[:c.start] for c in history])
        token_rows = np.repeat([c.state.row for c in history], lengths)
        is_output = np.concatenate([np.arange(c.start) >= c.state.num_prompt_tokens
                                    for c in history])
        size = self.buckets[-1]
        for offset in range(0, len(token_ids), size):
            part = slice(offset, offset + size)
            self._run_history(token_ids[part], token_rows[part], is_output[part],
                              [c.state.row for c in history] if offset == 0 else [])
        for c in history:
            c.state.new = False

    def _run_history(self, token_ids, token_rows, is_output, reset_rows) -> None:
        """One record_history program: at most the largest bucket's tokens, padded to it."""
        size, num_rows = self.buckets[-1], self.garbage_row

        def padded(values, length, fill, dtype):
            out = np.full(length, fill, dtype)
            out[:len(values)] = values
            return out

        packed, layout = pack(HistoryInputs(
            padded(token_ids, size, 0, np.int32), padded(token_rows, size, num_rows, np.int32),
            padded(is_output, size, False, bool), padded(reset_rows, num_rows, num_rows, np.int32)))
        self.state.penalty_state = step_fn.record_history(
            self.state.penalty_state, packed, layout=layout, model=self.model)

    def _build_inputs(self, rank_chunks: list[list[ScheduledChunk]], num_tokens_padded: int,
                      num_seqs_padded: int) -> tuple[StepInputs, tuple]:
        """The step's inputs, and where each chunk sits in the batch. DP ranks are padded to
        one bucket and concatenated rank-major: rank r's tokens are rows [r*T, (r+1)*T) and its
        sequences rows [r*S, (r+1)*S); block tables, slot mappings, cu_q_lens, kv_lens and
        num_seqs stay local to the rank (its attention sees its own slice), only
        logits_indices address the global token array."""
        ranks = [self._rank_inputs(chunks, num_tokens_padded, num_seqs_padded)
                 for chunks in rank_chunks]
        if len(ranks) == 1:
            inputs = ranks[0].inputs
        else:
            inputs = jax.tree.map(lambda *leaves: np.concatenate(leaves),
                                  *(r.inputs for r in ranks))
            inputs.batch.logits_indices += np.repeat(
                np.arange(len(ranks), dtype=np.int32) * num_tokens_padded, num_seqs_padded)
        placement = _placement(ranks, num_tokens_padded, num_seqs_padded)
        if self.draft_rows is None:
            inputs.sampling = self._sampling_metadata(rank_chunks, num_seqs_padded)
        else:  # one rank: its sequences' rows become their first sampling rows
            first_rows = self.draft_rows.apply(inputs, rank_chunks[0])
            placement = (placement[0], first_rows, *placement[2:])
        inputs.any_prompt_logprobs = np.array(bool(placement[3]))
        return inputs, placement

    def _rank_inputs(self, chunks: list[ScheduledChunk], num_tokens_padded: int,
                     num_seqs_padded: int) -> _RankInputs:
        num_seqs = len(chunks)
        rows = np.fromiter((c.state.row for c in chunks), np.int32, num_seqs)
        batch = build_step_batch(
            [SeqChunk(c.token_ids, c.start) for c in chunks], num_tokens_padded,
            num_seqs_padded, self.max_blocks_per_seq, self.block_size,
            block_tables=self.requests.block_tables.gather(rows, num_seqs_padded))
        num_tokens = int(batch.cu_q_lens[num_seqs])
        q_lens = np.diff(batch.cu_q_lens[:num_seqs + 1])
        num_prompt = np.fromiter((c.state.num_prompt_tokens for c in chunks), np.int32, num_seqs)

        def per_seq(values) -> np.ndarray:
            out = np.full(num_seqs_padded, self.garbage_row, np.int32)
            out[:num_seqs] = values
            return out

        token_rows = np.full(num_tokens_padded, self.garbage_row, np.int32)
        token_rows[:num_tokens] = np.repeat(rows, q_lens)
        token_is_output = np.zeros(num_tokens_padded, bool)
        token_is_output[:num_tokens] = (batch.positions[:num_tokens]
                                        >= np.repeat(num_prompt, q_lens))
        if self.lora is not None:
            batch.lora_slots = np.zeros(num_tokens_padded, np.int32)
            batch.lora_slots[:num_tokens] = np.repeat(
                np.fromiter((c.state.lora_slot for c in chunks), np.int32, num_seqs), q_lens)
        next_prompt_ids, want_prompt = self._next_prompt_ids(chunks, batch, num_tokens_padded)
        inputs = StepInputs(
            batch=batch, sampling=None, token_rows=token_rows, token_is_output=token_is_output,
            reset_rows=per_seq([c.state.row if c.state.new else self.garbage_row
                                for c in chunks]),
            seq_rows=per_seq(rows),
            sample_rows=per_seq([c.state.row if c.samples else self.garbage_row
                                 for c in chunks]),
            next_prompt_ids=next_prompt_ids, any_prompt_logprobs=None)
        return _RankInputs(inputs, chunks, want_prompt)

    @staticmethod
    def _sampling_metadata(rank_chunks: list[list[ScheduledChunk]], num_seqs_padded: int):
        """Rank r's sequences are rows [r*S, r*S + its count); the rows between are padding."""
        params, output_indices, seeds = [], [], []
        for rank, chunks in enumerate(rank_chunks):
            pad = rank * num_seqs_padded - len(params)  # the previous rank's padding rows
            params += [None] * pad
            output_indices += [0] * pad
            seeds += [0] * pad
            params += [c.state.sampling_params if c.samples else None for c in chunks]
            output_indices += [c.num_output_tokens for c in chunks]
            seeds += [c.state.sampling_params.seed for c in chunks]  # the engine seeds each
        return sampler.build_sampling_metadata(params, output_indices=output_indices, seeds=seeds,
                                               num_seqs_padded=len(rank_chunks) * num_seqs_padded)

    @staticmethod
    def _next_prompt_ids(chunks: list[ScheduledChunk], batch, num_tokens_padded: int):
        """For prompt logprobs: at each prompt token of a request that asks for them, the id of
        the prompt token after it (0 elsewhere); and which requests those are."""
        next_ids = np.zeros(num_tokens_padded, np.int32)
        want = []
        for i, c in enumerate(chunks):
            if (c.state.sampling_params.prompt_logprobs is None
                    or c.start >= c.state.num_prompt_tokens - 1):
                continue
            start = batch.cu_q_lens[i]
            following = c.token_ids[1:] + [c.next_token_id]
            next_ids[start:start + len(following)] = following
            want.append(i)
        return next_ids, want

    def collect(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Waits for the step, fetches its tokens (and logprobs) to the host and records the
        tokens in each request's state."""
        chunks, want_prompt = launched.chunks, launched.want_prompt
        want_logprobs = any(c.samples and c.state.sampling_params.logprobs is not None
                            for c in chunks)
        # The one device-to-host transfer of the step.
        token_ids, logprobs, prompt_lp, num_accepted, drafts = jax.device_get(
            (launched.sampled.token_ids, launched.sampled.logprobs if want_logprobs else None,
             launched.prompt_logprobs if want_prompt else None, launched.num_accepted,
             launched.drafts))
        sampled, sample_logprobs = {}, {}
        draft_token_ids = None if drafts is None else {}
        for i, (c, row) in enumerate(zip(chunks, launched.batch_rows.tolist())):
            if not c.samples:
                continue
            request_id = c.state.request_id
            # rows of a verified run: its accepted drafts, then the bonus or correction
            num_tokens = 1 if num_accepted is None else int(num_accepted[i]) + 1
            sampled[request_id] = token_ids[row:row + num_tokens].tolist()
            self.requests.record_sampled(request_id, sampled[request_id])
            if drafts is not None:  # sequence i's drafts, up to the first -1
                draft_token_ids[request_id] = _until_negative(drafts[i])
            num_top = c.state.sampling_params.logprobs
            if want_logprobs and num_top is not None:
                sample_logprobs[request_id] = [_logprob_entry(logprobs, r, num_top)
                                               for r in range(row, row + num_tokens)]
        prompt_logprobs = {}
        for i in want_prompt:
            c = chunks[i]
            start = launched.token_starts[i]
            # token j of the chunk scores prompt token start + j + 1
            last = min(len(c.token_ids), c.state.num_prompt_tokens - 1 - c.start)
            prompt_logprobs[c.state.request_id] = [
                (c.start + j + 1,
                 _logprob_entry(prompt_lp, start + j, c.state.sampling_params.prompt_logprobs))
                for j in range(last)]
        return ModelRunnerOutput(sampled, sample_logprobs, prompt_logprobs, draft_token_ids)

    # -- warm-up and profiling ---------------------------------------------------------------
    def _padding_inputs(self, num_tokens_padded: int) -> StepInputs:
        """Step inputs of an all-padding batch (every rank idle): it compiles the bucket and
        only writes block 0."""
        return self._build_inputs([[]] * self.dp_size, *self.bucket_for(num_tokens_padded))[0]

    def activation_bytes(self) -> int:
        """Temporary device memory of the largest bucket's programs, from XLA's memory analysis:
        the step with every sampler stage and, run after it with lean steps, prompt logprobs
        over the step's hidden states (its output stays alive meanwhile)."""
        inputs = self._padding_inputs(self.buckets[-1])
        packed, layout = pack(inputs)
        lowered = self._lower(packed, layout, self.programs[-1])
        step = lowered.compile().memory_analysis()
        peak = _temp_bytes(step)
        if self.lean_steps:
            hidden = lowered.out_info[0].hidden  # [T, H]
            prompt = step_fn.prompt_logprobs.lower(
                self.params, hidden, inputs.next_prompt_ids, model=self.model).compile()
            peak = max(peak, _temp_bytes(prompt.memory_analysis())
                       + int(getattr(step, "output_size_in_bytes", 0)))
        return peak

    def warmup(self, progress: Callable[[str], None] = logger.info) -> None:
        """Compiles every bucket's programs ahead of time, then runs each once (with lean steps
        also the prompt-logprobs program, through jit); steps go through these executables, so
        nothing compiles while serving. Tracing holds the GIL, so programs are traced one at a
        time, and each compiles in a thread pool (XLA compiles without the GIL) while the next
        ones are traced."""
        start = time.perf_counter()
        programs = [(n, stages) for n in self.buckets for stages in self.programs]
        futures = {}
        with ThreadPoolExecutor(max(1, min(len(programs), os.cpu_count() or 1))) as pool:
            for num_tokens_padded, stages in programs:
                packed, layout = pack(self._padding_inputs(num_tokens_padded))
                lowered = self._lower(packed, layout, stages)
                futures[pool.submit(lowered.compile)] = (layout, stages, num_tokens_padded)
            if self.pipeline is not None:  # the stages before the last
                self.pipeline.warmup([pack(self._padding_inputs(n)) for n in self.buckets], pool)
            progress(f"warm-up: traced {len(programs)} programs, "
                     f"{time.perf_counter() - start:.1f}s")
            for n, future in enumerate(as_completed(futures), 1):
                layout, stages, num_tokens_padded = futures[future]
                self._compiled[layout, stages] = future.result()
                progress(f"warm-up: compiled {n}/{len(programs)} ({num_tokens_padded} tokens, "
                         f"{stages}), {time.perf_counter() - start:.1f}s")
            # Each bucket once; the prompt-logprobs programs compile (through jit, on the
            # steps' own hidden states) and the drafting programs (ahead of time, traced here:
            # one per bucket, whatever its sampler stages) in the pool while the next steps run.
            prompt_programs, draft_programs = [], {}
            for num_tokens_padded, stages in programs:
                inputs = self._padding_inputs(num_tokens_padded)
                out = self._run_step(inputs, stages)
                jax.block_until_ready(out.sampled)
                if self.drafter is not None and stages == self.programs[0]:
                    layout, lowered = self.drafter.lower(self.params, inputs,
                                                         *self._draft_step_outputs(out))
                    draft_programs[layout] = pool.submit(lowered.compile)
                if stages == SamplerStages.ALL:
                    prompt_programs.append(pool.submit(
                        partial(step_fn.prompt_logprobs, model=self.model), self.params,
                        out.hidden, np.zeros(num_tokens_padded, np.int32)))
            jax.block_until_ready([future.result() for future in prompt_programs])
            for layout, future in draft_programs.items():
                self.drafter.add_compiled(layout, future.result())
        self._run_history([], [], [], [])  # the prefix-hit penalty program, compiled once
        if self.lora is not None:
            self.lora.warmup()
            self.params = self.lora.with_stacks(self.params)
        progress(f"warm-up: done, {time.perf_counter() - start:.1f}s")
