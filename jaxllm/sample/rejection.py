"""Verification of draft tokens: exact rejection sampling for deterministic drafts.

A step with drafts samples at N rows, one per position where the target model predicts a token:
a request with k drafts has k + 1 rows (after its last known token and after each draft), any
other request one. sample() draws every row's token exactly as without speculation, from the
row's own processed target distribution p (penalties counting the earlier drafts of the row's
request, min-tokens, temperature, min-p, top-k, top-p) with the row's own key
fold_in(key(seed), output index). Row j's draft d_j is accepted iff that draw equals it, and the
request's tokens are its accepted drafts plus the draw at its first rejected row (or at its last
row, the bonus token).

For a proposer whose draft is a point mass (n-gram, or any greedy draft), this is rejection
sampling (Leviathan et al., Chen et al.) exactly: d is accepted with probability p(d), and on
rejection the draw, conditioned on differing from d, follows p with d removed and renormalised,
the residual normalize(max(p - q, 0)) for q a point mass at d. It also makes each output token
the token the same seed draws without speculation: a seeded request generates the same text
with and without speculation (up to floating-point differences between a verification step's
logits and a one-token step's), and greedy output is the argmax at every position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.sample.penalties import PenaltyState


@jax.tree_util.register_dataclass
@dataclass
class DraftRows:
    """Where the drafts of a step sit among its N sampling rows (S sequences, K = k)."""
    draft_ids: jax.Array  # [N] i32: the draft the row's draw is compared with; -1: none
    row_seq: jax.Array  # [N] i32: the row's sequence (padding rows: the last sequence)
    first_row: jax.Array  # [S] i32: each sequence's first row (padding sequences: 0)
    prior_draft_ids: jax.Array  # [N, K] i32: drafts before the row in its sequence, -1 padded


@jax.tree_util.register_dataclass
@dataclass
class Verified:
    num_accepted: jax.Array  # [S] i32: accepted drafts per sequence
    last_token: jax.Array  # [S] i32: the token after them (the bonus or the correction)
    accepted: jax.Array  # [N] bool: the row's draft is accepted


def verify(token_ids: jax.Array, rows: DraftRows) -> Verified:
    """token_ids [N]: each row's draw. A sequence accepts its drafts up to its first row whose
    draw differs from the row's draft; rows without a draft (-1) always differ, so every
    sequence's last row ends its run."""
    mismatch = (token_ids != rows.draft_ids).astype(jnp.int32)
    mismatches_through = jnp.cumsum(mismatch)  # [N] inclusive
    before_seq = jnp.where(rows.first_row > 0, mismatches_through[rows.first_row - 1], 0)
    accepted = mismatches_through == before_seq[rows.row_seq]  # no mismatch in the seq so far
    num_seqs = rows.first_row.shape[0]
    num_accepted = jax.ops.segment_sum(accepted.astype(jnp.int32), rows.row_seq,
                                       num_segments=num_seqs)
    last_row = jnp.minimum(rows.first_row + num_accepted, token_ids.shape[0] - 1)
    return Verified(num_accepted, token_ids[last_row], accepted)


def count_prior_drafts(counts: jax.Array, prior_draft_ids: jax.Array) -> jax.Array:
    """counts [N, V] of output tokens per row, plus the drafts before each row ([N, K], -1
    padded): at a later position of a run the earlier drafts are outputs already."""
    vocab_size = counts.shape[-1]
    ids = jnp.where(prior_draft_ids < 0, vocab_size, prior_draft_ids)  # dropped by the scatter
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    return counts.at[rows, ids].add(1, mode="drop")


def record_accepted(state: PenaltyState, seq_rows: jax.Array, rows: DraftRows,
                    verified: Verified) -> PenaltyState:
    """Adds the accepted drafts to their requests' output counts (seq_rows [N]: each row's
    penalty row). Drafts are kept out of the counts as step inputs, since most may be rejected;
    the token after the accepted ones is counted as the next step's input, as without drafts."""
    draft_ids = jnp.maximum(rows.draft_ids, 0)
    counts = state.output_counts.at[seq_rows, draft_ids].add(verified.accepted.astype(jnp.int32))
    return dataclasses.replace(state, output_counts=counts)
