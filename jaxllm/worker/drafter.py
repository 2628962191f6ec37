"""Drafting on device, right after each target step: speculative decoding's eagle, eagle3 and
draft_model methods (vLLM's EagleProposer and draft-model proposer), in one program.

The drafter's KV cache lives under the target's block tables: position j of a request is in
the same slot for both (an EAGLE head's one layer; every layer of a draft model). After the
step's tokens are verified, a program
  1. runs the drafter over the step's own ragged batch (same positions and slots), writing its
     KV for every position the target computed; positions of rejected drafts are rewritten
     when the target recomputes them, as the target's own KV is. A draft model reads the
     step's tokens as the target did. An EAGLE head pairs position j with the token after it
     and the target's feature at j: the step's next input token, and at a sequence's last
     accepted position p the token the step just sampled (the bonus or the correction; for a
     prefill chunk that samples nothing, the next prompt token); its output at p is already
     the draft for p + 2.
  2. drafts greedily with one single-token pass per draft still missing, each writing its KV
     one position on (overwritten by the next step's pass 1). A draft model's first reads the
     token the step sampled, at p + 1.
A draft position outside the blocks the request holds ends its drafts there (its KV write would
land in a block that is not the request's).

The step's input tokens come from the step's own output: under async scheduling a step's host
batch holds placeholders for tokens still on the device. Inputs arrive as one packed buffer
(worker/packing.py); the drafts stay on device until the step's tokens are fetched, in the same
transfer.
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
from jaxllm.models.args import ModelArgs
from jaxllm.models.batch import StepBatch
from jaxllm.models.layer_stacks import layer_views
from jaxllm.models.transformer import embed_tokens, forward, run_layers
from jaxllm.worker.packing import PackLayout, pack, unpack
from pallas_kernels.kv_write import write_kv_reference


@jax.tree_util.register_dataclass
@dataclass
class DraftInputs:
    """S sequences, T tokens of the target step."""
    batch: StepBatch  # the step's batch (its token_ids and logits_indices unused)
    last_known: jax.Array  # [S] i32 flat index of each sequence's last token before its drafts
    samples: jax.Array  # [S] bool: the sequence sampled in the step
    first_row: jax.Array  # [S] i32 its first sampling row
    next_prompt_id: jax.Array  # [S] i32 a prefill chunk's next prompt token (else unused)
    num_positions: jax.Array  # [S] i32 positions its blocks hold (0: padding)


@dataclass(frozen=True)
class EagleDraft:
    """An EAGLE / EAGLE-3 head: one decoder layer over the target's features."""
    head: eagle.EagleArgs

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim) of its cache."""
        return 1, self.head.layer.num_kv_heads, self.head.layer.head_dim

    @staticmethod
    def dtype(params):
        """Its compute (and KV cache) dtype."""
        return params["fc"].dtype

    def first(self, params, target_params, kv_cache, batch: StepBatch, last, next_token,
              features, attn):
        """Pass 1 -> (drafts so far, the last draft [S], what the next pass reads, kv_cache)."""
        next_ids = jnp.roll(batch.token_ids, -1).at[last].set(next_token, mode="drop")
        hidden, kv_cache = self._run(params, target_params, kv_cache,
                                     dataclasses.replace(batch, token_ids=next_ids),
                                     eagle.input_features(self.head, params, features), attn)
        hidden = hidden[jnp.minimum(last, batch.token_ids.shape[0] - 1)]
        token = eagle.draft_token_ids(self.head, params, target_params, hidden)
        return [token], token, hidden, kv_cache

    def next(self, params, target_params, kv_cache, single: StepBatch, hidden, attn):
        """A single-token pass: the feature fed back is the head's own output."""
        hidden, kv_cache = self._run(params, target_params, kv_cache, single, hidden, attn)
        return eagle.draft_token_ids(self.head, params, target_params, hidden), hidden, kv_cache

    def _run(self, params, target_params, kv_cache, batch, features, attn):
        hidden, cache = eagle.draft_hidden(self.head, params, target_params["embed"],
                                           kv_cache[0], batch, features, attn=attn,
                                           write_kv=write_kv_reference)
        return hidden, [cache]


@dataclass(frozen=True)
class ModelDraft:
    """A smaller model with the target's vocabulary (method draft_model)."""
    args: ModelArgs

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        return self.args.num_layers, self.args.num_kv_heads, self.args.head_dim

    @staticmethod
    def dtype(params):
        return params["embed"].dtype

    def first(self, params, target_params, kv_cache, batch: StepBatch, last, next_token,
              features, attn):
        """Pass 1 only writes the KV (no logits): the first draft follows the sampled token."""
        _, kv_cache = run_layers(layer_views(params), kv_cache, embed_tokens(params, batch), batch,
                                 args=self.args, attn=attn, write_kv=write_kv_reference)
        return [], next_token, None, kv_cache

    def next(self, params, target_params, kv_cache, single: StepBatch, carry, attn):
        logits, kv_cache = forward(params, kv_cache, single, args=self.args, attn=attn,
                                   write_kv=write_kv_reference)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, kv_cache


@dataclass(frozen=True)
class DraftProgram:
    """The static part of the drafting program."""
    draft: EagleDraft | ModelDraft
    num_drafts: int
    attn: Callable
    block_size: int


@partial(jax.jit, donate_argnames=("kv_cache",), static_argnames=("program", "layout"))
def propose(params, target_params, kv_cache, packed_inputs: jax.Array, token_ids: jax.Array,
            features, sampled_ids: jax.Array, num_accepted: jax.Array, *,
            program: DraftProgram, layout: PackLayout):
    """-> (drafts [S, k] i32, -1 past a sequence's last draft; the drafter's kv_cache).
    token_ids [T]: the step's input tokens; features [T, F]: its (EAGLE) or None; sampled_ids
    [N]: its sampling rows' tokens; num_accepted [S]."""
    inputs: DraftInputs = unpack(packed_inputs, layout)
    batch = dataclasses.replace(inputs.batch, token_ids=token_ids)
    num_tokens = token_ids.shape[0]
    # Padding sequences point past the tokens: their scatters are dropped, their gathers clipped.
    last = inputs.last_known + jnp.where(inputs.samples, num_accepted, 0)
    sampled_last = sampled_ids[jnp.minimum(inputs.first_row + num_accepted,
                                           sampled_ids.shape[0] - 1)]
    next_token = jnp.where(inputs.samples, sampled_last, inputs.next_prompt_id)  # at p + 1
    drafts, token, carry, kv_cache = program.draft.first(
        params, target_params, kv_cache, batch, last, next_token, features, program.attn)
    position = batch.positions[jnp.minimum(last, num_tokens - 1)]
    live = jnp.ones_like(position, bool)
    num_blocks = jax.tree.leaves(kv_cache)[0].shape[0]
    while len(drafts) < program.num_drafts:
        position = position + 1
        live = live & (position < inputs.num_positions)
        single = _single_token_batch(batch, token, position, live, num_blocks,
                                     program.block_size)
        token, carry, kv_cache = program.draft.next(params, target_params, kv_cache, single,
                                                    carry, program.attn)
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


class Drafter:
    """The drafter's params and KV cache, and the host side of each drafting program."""

    def __init__(self, draft: EagleDraft | ModelDraft, params: dict, kv_cache, num_drafts: int,
                 attn: Callable, block_size: int) -> None:
        self.params = params
        self.kv_cache = kv_cache  # [(k_cache, v_cache)] per layer
        self.program = DraftProgram(draft, num_drafts, attn, block_size)
        self._compiled: dict = {}  # packed-input layout -> the program compiled for it

    @property
    def reads_features(self) -> bool:
        return isinstance(self.program.draft, EagleDraft)

    def launch(self, target_params, step_inputs, chunks, first_rows: np.ndarray,
               num_blocks: np.ndarray, token_ids, features, sampled_ids, num_accepted):
        """Dispatches the drafting program for a step (its StepInputs and chunks, each chunk's
        first sampling row and block count; its input tokens and features on device), through
        the executable the warm-up compiled for it (else jit); returns the drafts [S, k] on
        device."""
        packed, layout = pack(self._inputs(step_inputs.batch, chunks, first_rows, num_blocks))
        args = self._args(target_params, packed, token_ids, features, sampled_ids, num_accepted)
        compiled = self._compiled.get(layout)
        if compiled is not None:
            drafts, self.kv_cache = compiled(*args)
        else:
            drafts, self.kv_cache = propose(*args, program=self.program, layout=layout)
        return drafts

    def lower(self, target_params, step_inputs, token_ids, features, sampled_ids,
              num_accepted):
        """(layout, the drafting program of a step's bucket lowered): the warm-up compiles
        these in its thread pool, as the steps'."""
        empty = np.zeros(0, np.int32)
        packed, layout = pack(self._inputs(step_inputs.batch, [], empty, empty))
        args = self._args(target_params, packed, token_ids, features, sampled_ids, num_accepted)
        return layout, propose.lower(*args, program=self.program, layout=layout)

    def add_compiled(self, layout: PackLayout, compiled) -> None:
        self._compiled[layout] = compiled

    def _args(self, target_params, packed, token_ids, features, sampled_ids, num_accepted):
        return (self.params, target_params, self.kv_cache, packed, token_ids,
                features if self.reads_features else None, sampled_ids, num_accepted)

    def _inputs(self, batch: StepBatch, chunks, first_rows: np.ndarray,
                num_blocks: np.ndarray) -> DraftInputs:
        num_tokens, num_seqs_padded = len(batch.token_ids), len(batch.kv_lens)
        num_seqs = len(chunks)
        ends = batch.cu_q_lens[1:num_seqs + 1]
        last_known = np.full(num_seqs_padded, num_tokens, np.int32)  # padding: out of range
        samples = np.zeros(num_seqs_padded, bool)
        first_row = np.zeros(num_seqs_padded, np.int32)
        next_prompt_id = np.zeros(num_seqs_padded, np.int32)
        num_positions = np.zeros(num_seqs_padded, np.int32)
        for i, c in enumerate(chunks):
            last_known[i] = ends[i] - 1 - c.num_draft_tokens
            samples[i] = c.samples
            if not c.samples:
                next_prompt_id[i] = c.next_token_id
        first_row[:num_seqs] = first_rows
        num_positions[:num_seqs] = num_blocks * self.program.block_size
        return DraftInputs(batch, last_known, samples, first_row, next_prompt_id, num_positions)
