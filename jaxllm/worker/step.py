"""The jitted step: model, then sampler, over one packed buffer of named inputs.

One program per (bucket layout, sampler stages). The KV cache, the penalty state and
`last_sampled` (StepState) are donated and come back updated; PLAIN programs return the
penalty state untouched (the runner runs them only for steps in which no request uses
penalties, and only such a request's counts change what it samples). Placeholder tokens
(PLACEHOLDER_TOKEN_ID: "what the step in flight samples for this request") are filled in on
device from `last_sampled`, one token per penalty row that every step updates, before the
embedding and the penalty counts see them; device order makes this exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.core.scheduler import PLACEHOLDER_TOKEN_ID
from jaxllm.models import compute_logits
from jaxllm.models.batch import StepBatch
from jaxllm.sample import sampler
from jaxllm.sample import rejection
from jaxllm.sample.logprobs import LogprobsTensors, chunked_logprobs, empty_logprobs
from jaxllm.sample.sampler import SamplerOutput, SamplerStages
from jaxllm.worker.kv_cache import cache_views, kept_as
from jaxllm.worker.packing import PackLayout, unpack


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    """Everything a step reads besides params and state; T tokens, S sequences, R penalty rows
    (the last one, R - 1, is the garbage row of padding)."""
    batch: StepBatch
    sampling: sampler.SamplingMetadata  # [S] rows
    token_rows: jax.Array  # [T] i32 penalty row of each token
    token_is_output: jax.Array  # [T] bool: an output token (counted by the penalties)
    reset_rows: jax.Array  # [S] i32 rows that start over (new requests), else the garbage row
    seq_rows: jax.Array  # [S] i32 penalty row of each sequence
    sample_rows: jax.Array  # [S] i32 rows whose sampled token is recorded, else garbage
    next_prompt_ids: jax.Array  # [T] i32 the prompt token after each (prompt logprobs), or 0
    any_prompt_logprobs: jax.Array  # [] bool
    # With speculative decoding (worker/draft_rows.py): the sampler runs over N rows, one per
    # position that samples (batch.logits_indices [N]), and `sampling` and `seq_rows` are [N].
    draft_rows: rejection.DraftRows | None = None


@jax.tree_util.register_dataclass
@dataclass
class StepState:
    """Device state every step donates and gets back."""
    kv_caches: list  # per layer (k_cache, v_cache), a float8 one on a CPU as Float8Bits
    penalty_state: sampler.PenaltyState
    last_sampled: jax.Array  # [R] i32 the token each penalty row sampled last


@jax.tree_util.register_dataclass
@dataclass
class StepOutput:
    sampled: SamplerOutput
    # COND programs: prompt logprobs [T] computed under a cond. Other programs: from the final
    # hidden states [T, H] prompt_logprobs() computes them when asked (EAGLE reads them too).
    prompt_logprobs: LogprobsTensors | None
    hidden: jax.Array | None
    num_accepted: jax.Array | None = None  # [S] accepted drafts (with draft_rows)
    aux: jax.Array | None = None  # [T, 3H] EAGLE-3's features (forward's aux_layers)
    token_ids: jax.Array | None = None  # [T] the step's input tokens, placeholders resolved


@dataclass(frozen=True)
class StepModel:
    """The static part of a step: the model function and where its logits live on a mesh."""
    forward: Callable  # (params, kv_caches, batch, return_hidden) -> (logits, caches, hidden)
    logits_split: NamedSharding | None  # the LM head's vocab split; None on one device

    @property
    def mesh(self) -> Mesh | None:
        return None if self.logits_split is None else self.logits_split.mesh

    def logits(self, params, hidden: jax.Array) -> jax.Array:
        return _gather_logits(compute_logits(params, hidden), self.logits_split)


def vocab_split(params) -> NamedSharding | None:
    """The sharding the LM head (or the tied embedding) gives the logits [N, V]; None on one
    device."""
    head = params.get("lm_head")
    sharding = (head if head is not None else params["embed"]).sharding
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec) + (None, None)
    return NamedSharding(sharding.mesh, P(None, spec[1] if head is not None else spec[0]))


def replicated(tree, mesh: Mesh | None):
    """tree constrained to be replicated over the mesh (unchanged on one device). The step
    keeps its unpacked inputs and token ids so: unconstrained, GSPMD gives them the sharding of
    their uses (DP attention's token rows over "data"), so slicing each from the packed buffer
    costs a collective-permute and record_tokens scatters split rows, then all-reduces the
    whole [rows, V] penalty state, every step."""
    if mesh is None:
        return tree
    spec = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), tree)


def _gather_logits(logits, split: NamedSharding | None):
    """The LM head is vocab-parallel, so logits arrive split over vocab. Left so, GSPMD turns
    every reduction over vocab in the sampler (argmax, softmax, sort, logprobs) into its own
    small collective; one all-gather of the logits leaves the sampler none. Constrained to the
    split first: otherwise GSPMD all-gathers the LM head's weight instead, every step."""
    if split is None:
        return logits
    return replicated(jax.lax.with_sharding_constraint(logits, split), split.mesh)


@partial(jax.jit, donate_argnames=("state",), static_argnames=("model", "layout", "stages"))
def step(params, state: StepState, packed_inputs: jax.Array, *, model: StepModel,
         layout: PackLayout, stages: SamplerStages) -> tuple[StepOutput, StepState]:
    inputs: StepInputs = replicated(unpack(packed_inputs, layout), model.mesh)
    token_ids = inputs.batch.token_ids
    token_ids = jnp.where(token_ids == PLACEHOLDER_TOKEN_ID,
                          state.last_sampled[inputs.token_rows], token_ids)
    batch = dataclasses.replace(inputs.batch, token_ids=replicated(token_ids, model.mesh))
    logits, kv_caches, hidden, *aux = model.forward(params, cache_views(state.kv_caches), batch,
                                                    return_hidden=True)
    aux = aux[0] if aux else None
    logits = _gather_logits(logits, model.logits_split)
    penalty_state = state.penalty_state
    penalties = stages not in (SamplerStages.PLAIN, SamplerStages.GREEDY)
    if penalties:
        penalty_state = sampler.record_tokens(penalty_state, batch.token_ids, inputs.token_rows,
                                              inputs.token_is_output, inputs.reset_rows)
    rows = inputs.draft_rows
    sampled = sampler.sample(logits, inputs.sampling, penalty_state, inputs.seq_rows, stages,
                             None if rows is None else rows.prior_draft_ids)
    last_tokens, num_accepted = sampled.token_ids, None
    if rows is not None:
        verified = rejection.verify(sampled.token_ids, rows)
        if penalties:
            penalty_state = rejection.record_accepted(penalty_state, inputs.seq_rows, rows,
                                                      verified)
        last_tokens, num_accepted = verified.last_token, verified.num_accepted
    last_sampled = state.last_sampled.at[inputs.sample_rows].set(last_tokens)
    new_state = StepState(kept_as(kv_caches, state.kv_caches), penalty_state,
                          last_sampled)
    if stages == SamplerStages.COND:
        prompt_lp = jax.lax.cond(
            inputs.any_prompt_logprobs,
            lambda: chunked_logprobs(partial(model.logits, params), hidden,
                                     inputs.next_prompt_ids),
            lambda: empty_logprobs(hidden.shape[0]))
        return StepOutput(sampled, prompt_lp, hidden, num_accepted, aux,
                          batch.token_ids), new_state
    return StepOutput(sampled, None, hidden, num_accepted, aux, batch.token_ids), new_state


@jax.tree_util.register_dataclass
@dataclass
class HistoryInputs:
    """Tokens a request had in the KV cache before its first step (a prefix cache hit): the
    penalty counts must see them although no step computes them. N tokens, S rows."""
    token_ids: jax.Array  # [N] i32
    token_rows: jax.Array  # [N] i32 penalty row of each, or the garbage row
    token_is_output: jax.Array  # [N] bool
    reset_rows: jax.Array  # [S] i32 rows that start over, else the garbage row


@partial(jax.jit, donate_argnames=("penalty_state",), static_argnames=("layout", "model"))
def record_history(penalty_state: sampler.PenaltyState, packed_inputs: jax.Array, *,
                   layout: PackLayout, model: StepModel) -> sampler.PenaltyState:
    """Records HistoryInputs into the penalty state: a program of its own, run before the step
    that admits such requests (only when one uses penalties)."""
    inputs: HistoryInputs = replicated(unpack(packed_inputs, layout), model.mesh)
    state = sampler.record_tokens(penalty_state, inputs.token_ids, inputs.token_rows,
                                  inputs.token_is_output, inputs.reset_rows)
    return replicated(state, model.mesh)


@partial(jax.jit, static_argnames=("model",))
def prompt_logprobs(params, hidden: jax.Array, next_prompt_ids: jax.Array, *,
                    model: StepModel) -> LogprobsTensors:
    """Prompt logprobs from a step's hidden states [T, H]: a program of its own after a step
    without conds, run only when a request asks."""
    return chunked_logprobs(partial(model.logits, params), hidden, next_prompt_ids)
