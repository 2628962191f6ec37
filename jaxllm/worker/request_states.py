"""The runner's per-request state, created from the scheduler's NewRequestData and updated from
its CachedRequestData (numpy, no JAX). Each step it tells the runner which tokens every
scheduled request computes (tokens still being sampled by a step in flight are placeholders)
and keeps each request's block table."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from jaxllm.core.scheduler import PLACEHOLDER_TOKEN_ID, NewRequestData, SchedulerOutput
from jaxllm.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    request_id: str
    num_prompt_tokens: int
    token_ids: array  # prompt and the outputs this runner has collected (C ints: see Request)
    sampling_params: SamplingParams
    row: int  # the request's row in the block tables and the sampler's penalty state
    num_computed_tokens: int = 0
    new: bool = True  # created by this step: its penalty row starts over
    lora_slot: int = 0  # the device slot of its LoRA adapter (0: the base model)
    # Some penalty is on: every step it is in records its tokens (the runner's _stages_for).
    uses_penalties: bool = field(init=False)

    def __post_init__(self) -> None:
        # Once per request, not per step: the runner asks of every scheduled request each step.
        p = self.sampling_params
        self.uses_penalties = (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                               or p.frequency_penalty != 0.0)


@dataclass(slots=True)
class ScheduledChunk:
    """What one request computes in a step."""
    state: RequestState
    token_ids: list[int]  # from position `start`; placeholders for tokens in flight
    start: int  # num_computed_tokens before the step
    samples: bool  # the chunk reaches the last token, so the step samples after it
    num_draft_tokens: int = 0  # the chunk's last tokens are drafts to verify

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Outputs before the first token this chunk samples (the sampler's seed index)."""
        return self.end - self.num_draft_tokens - self.state.num_prompt_tokens

    @property
    def next_token_id(self) -> int:
        """The known token after the chunk (-1 if none): prompt logprobs score it."""
        token_ids = self.state.token_ids
        return token_ids[self.end] if self.end < len(token_ids) else -1


class BlockTables:
    """Block tables kept per row across steps, so a step copies only the blocks the scheduler
    added instead of every sequence's whole table (most decode steps add none)."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), np.int32)  # [R, B]
        self.num_blocks = np.zeros(num_rows, np.int32)  # [R]

    def set_row(self, row: int, block_ids: list[int]) -> None:
        self.table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)

    def append(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.table[row, start:start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    def gather(self, rows: np.ndarray, num_seqs_padded: int) -> np.ndarray:
        """[S, B]: the tables of `rows`, then zero rows for padding sequences."""
        out = np.zeros((num_seqs_padded, self.table.shape[1]), np.int32)
        out[:len(rows)] = self.table[rows]
        return out


@dataclass
class RequestStates:
    num_rows: int
    max_blocks_per_seq: int
    states: dict[str, RequestState] = field(default_factory=dict)
    free_rows: list[int] = field(init=False)
    block_tables: BlockTables = field(init=False)

    def __post_init__(self) -> None:
        self.free_rows = list(range(self.num_rows - 1, -1, -1))
        self.block_tables = BlockTables(self.num_rows, self.max_blocks_per_seq)

    def release(self, request_ids: Iterable[str]) -> None:
        """Drops finished or preempted requests; their rows go back to the free list."""
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.free_rows.append(state.row)

    def _add(self, new: NewRequestData) -> RequestState:
        token_ids = array("i", new.prompt_token_ids)
        token_ids.extend(new.output_token_ids)
        state = RequestState(new.request_id, len(new.prompt_token_ids), token_ids,
                             new.sampling_params, self.free_rows.pop(), new.num_computed_tokens)
        self.states[new.request_id] = state
        self.block_tables.set_row(state.row, new.block_ids)
        return state

    def apply(self, output: SchedulerOutput) -> list[ScheduledChunk]:
        """Applies one step's SchedulerOutput; returns its chunks in batch order. Runs every
        step for every scheduled request: plain loops, no per-request helpers."""
        self.release(output.finished_req_ids | output.preempted_req_ids)
        num_scheduled, drafts = output.num_scheduled_tokens, output.scheduled_spec_decode_tokens
        states, chunks = self.states, []
        for cached in output.scheduled_cached_reqs:
            request_id, start = cached.request_id, cached.num_computed_tokens
            state = states[request_id]
            state.num_computed_tokens = start
            state.new = False
            if cached.new_block_ids:
                self.block_tables.append(state.row, cached.new_block_ids)
            num_tokens = num_scheduled[request_id]
            if num_tokens == 1 and not drafts:  # a decode: its one token, or a placeholder
                token_ids = state.token_ids
                known = start < len(token_ids)
                chunks.append(ScheduledChunk(
                    state, [token_ids[start] if known else PLACEHOLDER_TOKEN_ID], start,
                    start + 1 >= len(token_ids)))
            else:
                chunks.append(_chunk(state, num_tokens,
                                     drafts.get(request_id) if drafts else None))
        for new in output.scheduled_new_reqs:
            chunks.append(_chunk(self._add(new), num_scheduled[new.request_id],
                                 drafts.get(new.request_id) if drafts else None))
        return chunks

    def record_sampled(self, request_id: str, token_ids: list[int]) -> None:
        """Appends a step's sampled tokens to a request still held."""
        state = self.states.get(request_id)
        if state is not None:
            state.token_ids.extend(token_ids)


def _chunk(state: RequestState, num_tokens: int, drafts: list[int] | None) -> ScheduledChunk:
    start, token_ids = state.num_computed_tokens, state.token_ids
    num_drafts = len(drafts) if drafts else 0
    end = start + num_tokens - num_drafts
    num_known = len(token_ids)
    chunk = token_ids[start:end].tolist()
    if end > num_known:
        chunk += [PLACEHOLDER_TOKEN_ID] * (end - max(start, num_known))
    if num_drafts:
        chunk += drafts
    return ScheduledChunk(state, chunk, start, end >= num_known, num_drafts)
