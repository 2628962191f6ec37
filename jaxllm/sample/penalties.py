"""Repetition, presence and frequency penalties from per-request token statistics kept on device.

Each running request owns one row of `PenaltyState` for its life (`seq_rows` maps the step's
sequences to rows); the last row is a garbage row that padding tokens and padding sequences
point at. The runner feeds every step's input tokens through `record_tokens` before sampling,
except in steps where no request uses penalties (its PLAIN programs): each position of a
request that uses penalties is fed exactly once per row life (prefill chunks feed the prompt,
a decode step feeds the previous output token, recompute after preemption re-feeds everything
after a reset), so the counts are exact when the next token is sampled. The counts of other
rows may be stale: their neutral penalties leave the logits unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class PenaltyState:
    output_counts: jax.Array  # [R, V] int32: times each token was generated
    prompt_mask: jax.Array  # [R, V] bool: token occurs in the prompt


def init_penalty_state(max_num_seqs: int, vocab_size: int) -> PenaltyState:
    rows = max_num_seqs + 1  # + the garbage row
    return PenaltyState(output_counts=jnp.zeros((rows, vocab_size), jnp.int32),
                        prompt_mask=jnp.zeros((rows, vocab_size), jnp.bool_))


def record_tokens(state: PenaltyState, token_ids: jax.Array, token_rows: jax.Array,
                  token_is_output: jax.Array, reset_rows: jax.Array) -> PenaltyState:
    """Zeroes reset_rows [S] (garbage row = no reset), then records token_ids [T] into
    token_rows [T]: prompt tokens set prompt_mask, output tokens add to output_counts."""
    # Unconditional (S rows of V, the garbage row on decode steps): a lax.cond would make a
    # GPU host wait for the device every step.
    counts = state.output_counts.at[reset_rows].set(0)
    prompt_mask = state.prompt_mask.at[reset_rows].set(False)
    counts = counts.at[token_rows, token_ids].add(token_is_output.astype(jnp.int32))
    prompt_mask = prompt_mask.at[token_rows, token_ids].max(~token_is_output)
    return PenaltyState(output_counts=counts, prompt_mask=prompt_mask)


def apply_penalties(logits: jax.Array, state: PenaltyState, seq_rows: jax.Array,
                    presence: jax.Array, frequency: jax.Array, repetition: jax.Array,
                    extra_counts=None) -> jax.Array:
    """vLLM's apply_penalties on logits [S, V]: repetition (HF style: divide positive logits,
    multiply negative ones) on prompt or output tokens, then OpenAI frequency and presence
    penalties on output tokens. The penalty vectors are [S]. extra_counts, when given, adds
    outputs the state has not recorded to the gathered counts [S, V] (draft tokens)."""
    counts = state.output_counts[seq_rows]  # [S, V]
    if extra_counts is not None:
        counts = extra_counts(counts)
    output_mask = counts > 0
    seen = state.prompt_mask[seq_rows] | output_mask
    penalty = jnp.where(seen, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency[:, None] * counts.astype(logits.dtype)
    return logits - presence[:, None] * output_mask.astype(logits.dtype)
