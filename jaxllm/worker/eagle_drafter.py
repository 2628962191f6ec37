"""EAGLE drafting on device, right after each target step (vLLM's EagleProposer, in one program).

The head's KV cache is one layer of pages under the target's block tables: position j of a
request lives in the same slot for both. After the step's tokens are verified, a program
  1. runs the head over the step's own ragged batch (same positions and slots), each position j
     pairing the token after it with the target's feature at j: the step's next input token, and
     at a sequence's last accepted position the token the step just sampled (the bonus or the
     correction; for a prefill chunk that samples nothing, the next prompt token). This writes
     the head's KV for every position the target computed; positions of rejected drafts are
     rewritten when the target recomputes them, as the target's own KV is.
  2. drafts k tokens greedily from the last accepted position: one single-token pass of the head
     per further draft, each writing its KV one position on (overwritten next step by 1).
A draft position outside the blocks the request holds ends its drafts there (its KV write would
land in a block that is not the request's).

Inputs arrive as one packed buffer (worker/packing.py); the drafts stay on device until the
step's tokens are fetched, in the same transfer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models import eagle
from jaxllm.models.batch import StepBatch
from jaxllm.worker.packing import PackLayout, pack, unpack
from pallas_kernels.kv_write import write_kv_reference


@jax.tree_util.register_dataclass
@dataclass
class EagleInputs:
    """S sequences, T tokens of the target step."""
    batch: StepBatch  # the step's batch (its logits_indices unused)
    next_token_ids: jax.Array  # [T] i32 each token's successor where the host knows it
    last_known: jax.Array  # [S] i32 flat index of each sequence's last token before its drafts
    samples: jax.Array  # [S] bool: the sequence sampled in the step
    first_row: jax.Array  # [S] i32 its first sampling row
    num_positions: jax.Array  # [S] i32 positions its blocks hold (0: padding)


@dataclass(frozen=True)
class DraftModel:
    """The static part of the drafting program."""
    head: eagle.EagleArgs
    num_drafts: int
    attn: Callable
    block_size: int


@partial(jax.jit, donate_argnames=("kv_cache",), static_argnames=("model", "layout"))
def propose(params, target_params, kv_cache, packed_inputs: jax.Array, features: jax.Array,
            sampled_ids: jax.Array, num_accepted: jax.Array, *, model: DraftModel,
            layout: PackLayout):
    """-> (drafts [S, k] i32, -1 past a sequence's last draft; the head's kv_cache).
    features [T, F]: the step's; sampled_ids [N]: its sampling rows' tokens; num_accepted [S]."""
    inputs: EagleInputs = unpack(packed_inputs, layout)
    batch, head = inputs.batch, model.head
    num_tokens = batch.token_ids.shape[0]
    # Padding sequences point past the tokens: their scatter is dropped, their gathers clipped.
    last = inputs.last_known + jnp.where(inputs.samples, num_accepted, 0)
    sampled_last = sampled_ids[jnp.minimum(inputs.first_row + num_accepted,
                                           sampled_ids.shape[0] - 1)]
    next_ids = inputs.next_token_ids.at[last].set(
        jnp.where(inputs.samples, sampled_last, inputs.next_token_ids[jnp.minimum(
            last, num_tokens - 1)]), mode="drop")
    run = partial(eagle.draft_hidden, head, params, target_params["embed"], attn=model.attn,
                  write_kv=write_kv_reference)
    hidden, kv_cache = run(kv_cache, dataclasses.replace(batch, token_ids=next_ids),
                           eagle.input_features(head, params, features))
    last = jnp.minimum(last, num_tokens - 1)
    hidden, position = hidden[last], batch.positions[last]  # [S, H], [S]
    token = eagle.draft_token_ids(head, params, target_params, hidden)
    drafts, live = [token], jnp.ones_like(token, bool)
    for step in range(1, model.num_drafts):
        position = position + 1
        live = live & (position < inputs.num_positions)
        single = _single_token_batch(batch, token, position, live, kv_cache[0].shape[0],
                                     model.block_size)
        hidden, kv_cache = run(kv_cache, single, hidden)
        token = eagle.draft_token_ids(head, params, target_params, hidden)
        drafts.append(jnp.where(live, token, -1))
    return jnp.stack(drafts, axis=1), kv_cache


def _single_token_batch(batch: StepBatch, token_ids, positions, live, num_blocks: int,
                        block_size: int) -> StepBatch:
    """One token per sequence at `positions`; a sequence not live reads one position and writes
    nothing (its slot is past the pool, a dropped scatter)."""
    num_seqs = positions.shape[0]
    positions = jnp.where(live, positions, 0)
    column = jnp.minimum(positions // block_size, batch.block_tables.shape[1] - 1)
    block = jnp.take_along_axis(batch.block_tables, column[:, None], axis=1)[:, 0]
    slots = jnp.where(live, block * block_size + positions % block_size, num_blocks * block_size)
    return StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slots,
                     block_tables=batch.block_tables,
                     cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32),
                     kv_lens=positions + 1, num_seqs=batch.num_seqs,
                     logits_indices=jnp.arange(num_seqs, dtype=jnp.int32))


class EagleDrafter:
    """The head's params and KV cache, and the host side of each drafting program."""

    def __init__(self, head: eagle.EagleArgs, params: dict, kv_cache, num_drafts: int,
                 attn: Callable, block_size: int) -> None:
        self.params = params
        self.kv_cache = kv_cache  # (k_cache, v_cache) of the head's one layer
        self.model = DraftModel(head, num_drafts, attn, block_size)

    def launch(self, target_params, step_inputs, chunks, first_rows: np.ndarray,
               num_blocks: np.ndarray, features, sampled_ids, num_accepted):
        """Dispatches the drafting program for a step (its StepInputs and chunks, each chunk's
        first sampling row and block count); returns the drafts [S, k] on device."""
        packed, layout = pack(self._inputs(step_inputs.batch, chunks, first_rows, num_blocks))
        drafts, self.kv_cache = propose(self.params, target_params, self.kv_cache, packed,
                                        features, sampled_ids, num_accepted, model=self.model,
                                        layout=layout)
        return drafts

    def _inputs(self, batch: StepBatch, chunks, first_rows: np.ndarray,
                num_blocks: np.ndarray) -> EagleInputs:
        num_tokens, num_seqs_padded = len(batch.token_ids), len(batch.kv_lens)
        num_seqs = len(chunks)
        ends = batch.cu_q_lens[1:num_seqs + 1]
        next_ids = np.zeros(num_tokens, np.int32)
        next_ids[:-1] = batch.token_ids[1:]
        last_known = np.full(num_seqs_padded, num_tokens, np.int32)  # padding: out of range
        samples = np.zeros(num_seqs_padded, bool)
        first_row = np.zeros(num_seqs_padded, np.int32)
        num_positions = np.zeros(num_seqs_padded, np.int32)
        for i, c in enumerate(chunks):
            last_known[i] = ends[i] - 1 - c.num_draft_tokens
            samples[i] = c.samples
            if not c.samples:  # a prefill chunk: the prompt token after it
                next_ids[last_known[i]] = c.next_token_id
        first_row[:num_seqs] = first_rows
        num_positions[:num_seqs] = num_blocks * self.model.block_size
        return EagleInputs(batch, next_ids, last_known, samples, first_row, num_positions)
