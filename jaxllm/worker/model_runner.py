"""The model runner: one jitted step per engine iteration over a fixed-bucket ragged batch.

Host side it turns a SchedulerOutput into a StepBatch plus sampling arrays (numpy only: an eager
jnp op here would compile for every new shape), launches the step with the KV cache and the
penalty state donated, and fetches the sampled tokens in one device-to-host transfer.

launch() returns as soon as the step is dispatched (jax dispatch is asynchronous) and collect()
waits for its tokens, so async scheduling can launch step N+1 before collecting step N. Step
N+1's placeholder tokens (PLACEHOLDER_TOKEN_ID: "what step N sampled for this request") are
filled in on device from `last_sampled`, one token per penalty row that every step updates,
before the embedding and the penalty counts see them. Device order makes this exact: step N
wrote the row before step N+1 reads it. The fill-in (a gather of T ids, a scatter of S) is
compiled in always, so one program serves both modes.

With DP attention (dp_size > 1, MoE with expert parallelism) one step serves every DP rank: each
rank's batch is padded to the busiest rank's bucket and the ranks are concatenated rank-major
(see _build_inputs); the sampler and penalty rows cover all ranks' sequences.
"""

from __future__ import annotations

import dataclasses
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.core.dp_scheduler import DPSchedulerOutput
from jaxllm.core.scheduler import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from jaxllm.models import compute_logits
from jaxllm.sample import sampler
from jaxllm.sample.logprobs import chunked_logprobs, empty_logprobs
from jaxllm.worker.batch import BlockTables, SeqChunk, build_step_batch
from jaxllm.worker.packing import pack, unpack

logger = logging.getLogger(__name__)


def token_buckets(max_num_batched_tokens: int, min_bucket: int = 16) -> list[int]:
    """Powers of two up to the token budget, which closes the list."""
    buckets, size = [], min(min_bucket, max_num_batched_tokens)
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_num_batched_tokens]


def _vocab_split(params) -> NamedSharding | None:
    """The sharding the LM head (or the tied embedding) gives the logits [N, V]; None on one
    device."""
    head = params.get("lm_head")
    sharding = (head if head is not None else params["embed"]).sharding
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None, None)
    return NamedSharding(sharding.mesh, P(None, spec[1] if head is not None else spec[0]))


def _replicated(tree, mesh: Mesh | None):
    """tree constrained to be replicated over the mesh (unchanged on one device). The step
    keeps its unpacked inputs and token ids so: unconstrained, GSPMD gives them the sharding of
    their uses (DP attention's token rows over "data"), so slicing each from the packed buffer
    costs a collective-permute and record_tokens scatters split rows, then all-reduces the
    whole [rows, V] penalty state, every step."""
    if mesh is None:
        return tree
    replicated = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, replicated), tree)


def _gather_logits(logits, split: NamedSharding | None):
    """The LM head is vocab-parallel, so logits arrive split over vocab. Left so, GSPMD turns
    every reduction over vocab in the sampler (argmax, softmax, sort, logprobs) into its own
    small collective (20 in a 2-layer TP=2 step with every sampler stage, beside the model's
    5); one all-gather of the logits leaves the sampler none. Constrained to the split
    first: otherwise GSPMD all-gathers the LM head's weight instead, every step."""
    if split is None:
        return logits
    return _replicated(jax.lax.with_sharding_constraint(logits, split), split.mesh)


# (chosen token's logprob, its rank, top ids, top logprobs)
LogprobEntry = tuple[float, int, list[int], list[float]]


def _logprob_entry(tensors, row: int, num_top: int) -> LogprobEntry:
    return (float(tensors.sampled_logprob[row]), int(tensors.sampled_rank[row]),
            tensors.top_ids[row, :num_top].tolist(), tensors.top_logprobs[row, :num_top].tolist())


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, LogprobEntry]  # sampled tokens' logprobs, only for requests that ask
    # request id -> [(prompt position scored, entry)], only for requests that ask
    prompt_logprobs: dict[str, list[tuple[int, LogprobEntry]]]


@dataclass
class LaunchedStep:
    """A dispatched step whose results are still on device."""
    scheduled: list[ScheduledRequest]  # DP ranks' grants rank-major
    batch_rows: np.ndarray  # [len(scheduled)] each request's sequence row in the batch
    token_starts: np.ndarray  # [len(scheduled)] flat index of each request's first token
    want_prompt: list[int]  # indices into scheduled of the requests that get prompt logprobs
    out: tuple  # (SamplerOutput, prompt LogprobsTensors) on device


def _placement(rank_scheduled, rank_cu_q_lens, rank_want_prompt, num_tokens_padded: int,
               num_seqs_padded: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """LaunchedStep's batch_rows, token_starts and want_prompt over the ranks, rank-major."""
    batch_rows, token_starts, want_prompt, offset = [], [], [], 0
    for rank, (scheduled, cu_q_lens, want) in enumerate(
            zip(rank_scheduled, rank_cu_q_lens, rank_want_prompt)):
        num_seqs = len(scheduled)
        batch_rows.append(rank * num_seqs_padded + np.arange(num_seqs))
        token_starts.append(rank * num_tokens_padded + cu_q_lens[:num_seqs])
        want_prompt += [offset + i for i in want]
        offset += num_seqs
    return np.concatenate(batch_rows), np.concatenate(token_starts), want_prompt


class ModelRunner:
    def __init__(self, model_fn: Callable, params, kv_caches, *, vocab_size: int, block_size: int,
                 max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                 dp_size: int = 1, lean_steps: bool | None = None) -> None:
        """dp_size > 1: DP attention, one step for dp_size ranks (max_num_seqs each) whose
        SchedulerOutputs come in one DPSchedulerOutput; the KV cache holds every rank's pool.

        lean_steps (default: on a GPU): no lax.cond in any step. On a GPU every cond makes the
        host wait for the device to reach it (XLA reads the predicate back), which stalls async
        scheduling. Each bucket then has two programs, "plain" (no top-k/top-p, no logprobs)
        for the batches that use neither and "all" (every sampler stage for every row) for
        the rest, and prompt logprobs run as a program of their own after the step, only when
        asked. Without lean steps one program per bucket runs each optional stage under a
        cond ("cond"), which is free on a CPU."""
        self.params = params
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.dp_size = dp_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buckets = token_buckets(max_num_batched_tokens)
        num_rows = dp_size * max_num_seqs  # penalty rows of every rank's sequences
        # On a mesh the sampler runs replicated (_gather_logits), so its state is replicated too;
        # placed so from the start, the second step does not recompile for a new sharding.
        split = _vocab_split(params)
        mesh = None if split is None else split.mesh
        place = (lambda x: x) if mesh is None else partial(  # noqa: E731
            jax.device_put, device=NamedSharding(mesh, P()))
        self.penalty_state = place(sampler.init_penalty_state(num_rows, vocab_size))
        # [num_rows + 1] the token each penalty row's request sampled last
        self.last_sampled = place(jnp.zeros(num_rows + 1, jnp.int32))
        self.garbage_row = num_rows  # padding sequences and tokens use the last row
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._rows: dict[str, int] = {}
        self.block_tables = BlockTables(num_rows + 1, self.max_blocks_per_seq)
        self.lean_steps = jax.default_backend() == "gpu" if lean_steps is None else lean_steps

        # Its own jit so that tracing it once per bucket serves both the full and lean programs
        # (inlined when the step is lowered; nothing changes at run time).
        model_fn = jax.jit(model_fn, static_argnames=("return_hidden",))

        def step(params, kv_caches, penalty_state, last_sampled, packed_inputs, layout, stages):
            (batch, sampling_md, token_rows, token_is_output, reset_rows, seq_rows, sample_rows,
             next_prompt_ids, any_prompt_logprobs) = _replicated(unpack(packed_inputs, layout),
                                                                 mesh)
            batch = dataclasses.replace(batch, token_ids=_replicated(jnp.where(
                batch.token_ids == PLACEHOLDER_TOKEN_ID, last_sampled[token_rows],
                batch.token_ids), mesh))
            logits, kv_caches, hidden = model_fn(params, kv_caches, batch, return_hidden=True)
            logits = _gather_logits(logits, split)
            penalty_state = sampler.record_tokens(penalty_state, batch.token_ids, token_rows,
                                                  token_is_output, reset_rows)
            out = sampler.sample(logits, sampling_md, penalty_state, seq_rows, stages)
            last_sampled = last_sampled.at[sample_rows].set(out.token_ids)
            if stages == "cond":
                prompt_logprobs = jax.lax.cond(
                    any_prompt_logprobs,
                    lambda: prompt_logprobs_of(params, hidden, next_prompt_ids),
                    lambda: empty_logprobs(hidden.shape[0]))
                return (out, prompt_logprobs), kv_caches, penalty_state, last_sampled
            return (out, hidden), kv_caches, penalty_state, last_sampled

        def prompt_logprobs_of(params, hidden, next_prompt_ids):
            return chunked_logprobs(lambda x: _gather_logits(compute_logits(params, x), split),
                                    hidden, next_prompt_ids)

        self._step = jax.jit(step, donate_argnums=(1, 2, 3), static_argnums=(5, 6))
        self._compiled: dict = {}  # (packed-input layout, stages) -> the step compiled for it
        self._prompt_logprobs = jax.jit(prompt_logprobs_of)  # after a lean step, when asked

    @property
    def programs(self) -> tuple[str, ...]:
        """The sampler stages each bucket is compiled with."""
        return ("plain", "all") if self.lean_steps else ("cond",)

    def _run_step(self, inputs: tuple, stages: str) -> tuple:
        """Runs the step on (batch, sampling_md, token_rows, token_is_output, reset_rows,
        seq_rows, sample_rows, next_prompt_ids, any_prompt_logprobs), sent as one packed
        buffer, through the executable the warm-up compiled for it (else jit); returns
        (SamplerOutput, prompt LogprobsTensors for "cond" else the hidden states) on device."""
        packed, layout = pack(inputs)
        state = (self.params, self.kv_caches, self.penalty_state, self.last_sampled, packed)
        compiled = self._compiled.get((layout, stages))
        out, self.kv_caches, self.penalty_state, self.last_sampled = (
            compiled(*state) if compiled is not None else self._step(*state, layout, stages))
        return out

    def _dispatch(self, inputs: tuple, stages: str = "cond"):
        """The step, then (cond-free programs) prompt logprobs when asked: (SamplerOutput,
        prompt LogprobsTensors or None) on device."""
        sample_out, extra = self._run_step(inputs, stages)
        if stages == "cond":
            return sample_out, extra
        next_prompt_ids, any_prompt_logprobs = inputs[7], inputs[8]
        return sample_out, (self._prompt_logprobs(self.params, extra, next_prompt_ids)
                            if any_prompt_logprobs else None)

    def _stages_for(self, inputs: tuple) -> str:
        sampling_md = inputs[1]
        if not self.lean_steps:
            return "cond"
        return "all" if sampling_md.any_top_k_top_p or sampling_md.any_logprobs else "plain"

    # -- per-request state ------------------------------------------------------------------
    def release(self, request_ids) -> None:
        """Frees the penalty rows of finished or preempted requests."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def _row_for(self, request_id: str) -> int:
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = self._free_rows.pop()
        return row

    # -- one step -----------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> tuple[int, int]:
        num_tokens_padded = next(b for b in self.buckets if b >= num_tokens)
        return num_tokens_padded, min(num_tokens_padded, self.max_num_seqs)

    def launch(self, scheduler_output: SchedulerOutput | DPSchedulerOutput) -> LaunchedStep:
        """Builds the step's inputs and dispatches it; returns without waiting for the device."""
        rank_outputs = (scheduler_output.ranks if isinstance(scheduler_output, DPSchedulerOutput)
                        else [scheduler_output])
        for out in rank_outputs:
            self.release(out.finished_request_ids)
            self.release(out.preempted_request_ids)
        num_tokens_padded, num_seqs_padded = self.bucket_for(
            max(out.num_scheduled_tokens for out in rank_outputs))
        inputs, placement = self._build_inputs([out.scheduled for out in rank_outputs],
                                               num_tokens_padded, num_seqs_padded)
        return LaunchedStep(scheduler_output.scheduled, *placement,
                            self._dispatch(inputs, self._stages_for(inputs)))

    def _build_inputs(self, rank_scheduled: list[list[ScheduledRequest]], num_tokens_padded: int,
                      num_seqs_padded: int) -> tuple[tuple, tuple]:
        """The step's inputs, and where each scheduled request sits in the batch. DP ranks are
        padded to one bucket and concatenated rank-major: rank r's tokens are rows
        [r*T, (r+1)*T) and its sequences rows [r*S, (r+1)*S); block tables, slot mappings,
        cu_q_lens, kv_lens and num_seqs stay local to the rank (its attention sees its own
        slice), only logits_indices address the global token array."""
        rank_inputs, want_prompt, cu_q_lens = zip(*(
            self._rank_inputs(scheduled, num_tokens_padded, num_seqs_padded)
            for scheduled in rank_scheduled))
        if len(rank_inputs) == 1:
            inputs = rank_inputs[0]
        else:
            inputs = jax.tree.map(lambda *leaves: np.concatenate(leaves), *rank_inputs)
            inputs[0].logits_indices += np.repeat(
                np.arange(len(rank_inputs), dtype=np.int32) * num_tokens_padded, num_seqs_padded)
        placement = _placement(rank_scheduled, cu_q_lens, want_prompt, num_tokens_padded,
                               num_seqs_padded)
        batch, *rows = inputs
        sampling_md = self._sampling_metadata(rank_scheduled, num_seqs_padded)
        return (batch, sampling_md, *rows, np.array(bool(placement[2]))), placement

    def _rank_inputs(self, scheduled: list[ScheduledRequest], num_tokens_padded: int,
                     num_seqs_padded: int):
        """One rank's (batch, token_rows, token_is_output, reset_rows, seq_rows, sample_rows,
        next_prompt_ids), the indices of its requests that want prompt logprobs, its cu_q_lens."""
        num_seqs = len(scheduled)
        rows = np.fromiter((self._row_for(s.request_id) for s in scheduled), np.int32, num_seqs)
        self.block_tables.record_grants(rows, scheduled)
        batch = build_step_batch(
            [SeqChunk(s.token_ids, s.num_computed_tokens) for s in scheduled],
            num_tokens_padded, num_seqs_padded, self.max_blocks_per_seq, self.block_size,
            block_tables=self.block_tables.gather(rows, num_seqs_padded))
        num_tokens = int(batch.cu_q_lens[num_seqs])
        num_prompt = np.fromiter((s.num_prompt_tokens for s in scheduled), np.int32, num_seqs)
        first_chunk = np.fromiter((s.num_computed_tokens == 0 for s in scheduled), bool, num_seqs)
        q_lens = np.diff(batch.cu_q_lens[:num_seqs + 1])
        seq_rows = np.full(num_seqs_padded, self.garbage_row, np.int32)
        seq_rows[:num_seqs] = rows
        reset_rows = np.full(num_seqs_padded, self.garbage_row, np.int32)
        reset_rows[:num_seqs] = np.where(first_chunk, rows, self.garbage_row)
        sample_rows = np.full(num_seqs_padded, self.garbage_row, np.int32)
        sample_rows[:num_seqs] = np.where([s.samples for s in scheduled], rows, self.garbage_row)
        token_rows = np.full(num_tokens_padded, self.garbage_row, np.int32)
        token_rows[:num_tokens] = np.repeat(rows, q_lens)
        token_is_output = np.zeros(num_tokens_padded, bool)
        token_is_output[:num_tokens] = (batch.positions[:num_tokens]
                                        >= np.repeat(num_prompt, q_lens))
        next_prompt_ids, want_prompt = self._next_prompt_ids(scheduled, batch, num_tokens_padded)
        return ((batch, token_rows, token_is_output, reset_rows, seq_rows, sample_rows,
                 next_prompt_ids), want_prompt, batch.cu_q_lens)

    @staticmethod
    def _sampling_metadata(rank_scheduled: list[list[ScheduledRequest]], num_seqs_padded: int):
        """Rank r's sequences are rows [r*S, r*S + its count); the rows between are padding."""
        params, output_indices, seeds = [], [], []
        for rank, scheduled in enumerate(rank_scheduled):
            pad = rank * num_seqs_padded - len(params)  # the previous rank's padding rows
            params += [None] * pad
            output_indices += [0] * pad
            seeds += [0] * pad
            params += [s.sampling_params if s.samples else None for s in scheduled]
            output_indices += [s.num_output_tokens for s in scheduled]
            seeds += [s.sampling_params.seed for s in scheduled]  # the engine seeds every request
        return sampler.build_sampling_metadata(params, output_indices=output_indices, seeds=seeds,
                                               num_seqs_padded=len(rank_scheduled) * num_seqs_padded)

    @staticmethod
    def _next_prompt_ids(scheduled, batch, num_tokens_padded: int):
        """For prompt logprobs: at each prompt token of a request that asks for them, the id of
        the prompt token after it (0 elsewhere); and which requests those are."""
        next_ids = np.zeros(num_tokens_padded, np.int32)
        want = []
        for i, s in enumerate(scheduled):
            if s.sampling_params.prompt_logprobs is None or s.num_computed_tokens >= \
                    s.num_prompt_tokens - 1:
                continue
            start = batch.cu_q_lens[i]
            following = s.token_ids[1:] + [s.next_token_id]
            next_ids[start:start + len(following)] = following
            want.append(i)
        return next_ids, want

    def collect(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Waits for the step and fetches its tokens (and logprobs) to the host."""
        scheduled, want_prompt = launched.scheduled, launched.want_prompt
        sample_out, prompt_out = launched.out
        want_logprobs = any(s.samples and s.sampling_params.logprobs is not None
                            for s in scheduled)
        # The one device-to-host transfer of the step.
        token_ids, logprobs, prompt_lp = jax.device_get(
            (sample_out.token_ids, sample_out.logprobs if want_logprobs else None,
             prompt_out if want_prompt else None))
        sampled, sample_logprobs = {}, {}
        for s, row in zip(scheduled, launched.batch_rows.tolist()):
            if not s.samples:
                continue
            sampled[s.request_id] = int(token_ids[row])
            if want_logprobs and s.sampling_params.logprobs is not None:
                sample_logprobs[s.request_id] = _logprob_entry(logprobs, row,
                                                               s.sampling_params.logprobs)
        prompt_logprobs = {}
        for i in want_prompt:
            s = scheduled[i]
            start = launched.token_starts[i]
            # token j of the chunk scores prompt token num_computed + j + 1
            last = min(len(s.token_ids), s.num_prompt_tokens - 1 - s.num_computed_tokens)
            prompt_logprobs[s.request_id] = [
                (s.num_computed_tokens + j + 1,
                 _logprob_entry(prompt_lp, start + j, s.sampling_params.prompt_logprobs))
                for j in range(last)]
        return ModelRunnerOutput(sampled, sample_logprobs, prompt_logprobs)

    # -- warm-up and profiling ---------------------------------------------------------------
    def _padding_inputs(self, num_tokens_padded: int) -> tuple:
        """Step arguments of an all-padding batch (every rank idle): it compiles the bucket and
        only writes block 0."""
        return self._build_inputs([[]] * self.dp_size, *self.bucket_for(num_tokens_padded))[0]

    def activation_bytes(self) -> int:
        """Temporary device memory of the largest bucket's step (its program with every sampler
        stage), from XLA's memory analysis."""
        packed, layout = pack(self._padding_inputs(self.buckets[-1]))
        compiled = self._step.lower(self.params, self.kv_caches, self.penalty_state,
                                    self.last_sampled, packed, layout, self.programs[-1]).compile()
        analysis = compiled.memory_analysis()
        return int(getattr(analysis, "temp_size_in_bytes", 0)) if analysis else 0

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
                lowered = self._step.lower(self.params, self.kv_caches, self.penalty_state,
                                           self.last_sampled, packed, layout, stages)
                futures[pool.submit(lowered.compile)] = (layout, stages, num_tokens_padded)
            progress(f"warm-up: traced {len(programs)} programs, "
                     f"{time.perf_counter() - start:.1f}s")
            for n, future in enumerate(as_completed(futures), 1):
                layout, stages, num_tokens_padded = futures[future]
                self._compiled[layout, stages] = future.result()
                progress(f"warm-up: compiled {n}/{len(programs)} ({num_tokens_padded} tokens, "
                         f"{stages}), {time.perf_counter() - start:.1f}s")
            # Each bucket once; the prompt-logprobs programs compile (through jit, on the
            # steps' own hidden states) in the pool while the next steps run.
            prompt_programs = []
            for num_tokens_padded, stages in programs:
                sample_out, extra = self._run_step(self._padding_inputs(num_tokens_padded),
                                                   stages)
                jax.block_until_ready(sample_out)
                if stages == "all":
                    prompt_programs.append(pool.submit(
                        self._prompt_logprobs, self.params, extra,
                        np.zeros(num_tokens_padded, np.int32)))
            jax.block_until_ready([future.result() for future in prompt_programs])
        progress(f"warm-up: done, {time.perf_counter() - start:.1f}s")
