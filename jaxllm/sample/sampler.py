"""The on-device sampler: one jittable function from logits to next tokens for a whole batch.

Order as vLLM V1's Sampler: logprobs from the raw logits; penalties; the min-tokens mask; greedy
rows take the argmax of those logits; random rows divide by their temperature, apply min-p,
then top-k and top-p, and draw with the Gumbel-max trick from their own key
fold_in(key(seed), output_index), so a seeded request draws the same token whatever else is in
the batch and wherever its row is.

Boundary ties: top-k keeps every token whose logit equals the k-th largest (as vLLM), and top-p
keeps every token whose logit equals the smallest one it needs, so both may keep a few more
tokens than k or than the nucleus when logits tie exactly; neither ever keeps a token below
its threshold.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.sample.logprobs import LogprobsTensors, empty_logprobs, gather_logprobs
from jaxllm.sample.metadata import SamplingMetadata, build_sampling_metadata
from jaxllm.sample.penalties import (PenaltyState, apply_penalties, init_penalty_state,
                                     record_tokens)
from jaxllm.sample.rejection import count_prior_drafts

# The runner's whole interface, importable from this one module.
__all__ = ["SamplerOutput", "SamplerStages", "SamplingMetadata", "PenaltyState", "all_greedy",
           "build_sampling_metadata", "init_penalty_state", "record_tokens", "sample",
           "gather_logprobs"]

_SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as vLLM


class SamplerStages(enum.StrEnum):
    """Which optional stages a sampler program runs, and how (see sample())."""
    COND = "cond"
    ALL = "all"
    PLAIN = "plain"
    GREEDY = "greedy"


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    token_ids: jax.Array  # [S] i32
    logprobs: LogprobsTensors  # zeros unless md.any_logprobs


def sample(logits: jax.Array, md: SamplingMetadata, state: PenaltyState,
           seq_rows: jax.Array, stages: SamplerStages = SamplerStages.COND,
           prior_draft_ids: jax.Array | None = None) -> SamplerOutput:
    """logits [S, V] f32 (one row per sequence), seq_rows [S] i32: each sequence's penalty row.

    stages (static): "cond" runs each optional stage (penalties, the random draw, top-k/top-p,
    logprobs) under a lax.cond on its batch flag, so one program serves any batch (a CPU runs a
    cond for free); "all" runs every stage and "plain" every stage but penalties, top-k/top-p
    and logprobs, both without a cond, since on a GPU each cond makes the host wait for the
    device (the runner picks one of the two per batch, "plain" only when no request of the
    step uses penalties); "greedy" is "plain" for a batch whose every row is greedy: the
    argmax alone, without the random draw's noise over [S, V]. A stage leaves rows that do not
    use it unchanged, so the four draw the same tokens.

    prior_draft_ids [S, K] (speculative decoding, rejection.py): the draft tokens before each
    row's position, which the penalties count as outputs.
    """
    stages = SamplerStages(stages)
    logits = logits.astype(jnp.float32)
    raw_logits = logits
    extra_counts = (None if prior_draft_ids is None
                    else lambda counts: count_prior_drafts(counts, prior_draft_ids))
    penalize = lambda x: apply_penalties(x, state, seq_rows, md.presence_penalty,  # noqa: E731
                                         md.frequency_penalty, md.repetition_penalty,
                                         extra_counts)
    if stages == "cond":
        logits = jax.lax.cond(md.any_penalties, penalize, lambda x: x, logits)
    elif stages == "all":
        logits = penalize(logits)
    logits = mask_ids(logits, md.min_tokens_stop_ids)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if stages == "greedy":
        return SamplerOutput(token_ids=greedy_ids, logprobs=empty_logprobs(logits.shape[0]))
    is_greedy = md.temperature < _SAMPLING_EPS
    if stages == "cond":
        token_ids = jax.lax.cond(
            jnp.all(is_greedy), lambda x: greedy_ids,
            lambda x: jnp.where(is_greedy, greedy_ids, _sample_random(x, md, stages)), logits)
        logprobs = jax.lax.cond(md.any_logprobs, lambda: gather_logprobs(raw_logits, token_ids),
                                lambda: empty_logprobs(logits.shape[0]))
    else:
        token_ids = jnp.where(is_greedy, greedy_ids, _sample_random(logits, md, stages))
        logprobs = (gather_logprobs(raw_logits, token_ids) if stages == "all"
                    else empty_logprobs(logits.shape[0]))
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def all_greedy(md: SamplingMetadata) -> bool:
    """On the host, before the step: whether every row of the batch (padding included)
    samples greedily."""
    return bool((md.temperature < _SAMPLING_EPS).all())


def _sample_random(logits: jax.Array, md: SamplingMetadata,
                   stages: SamplerStages) -> jax.Array:
    temperature = jnp.where(md.temperature < _SAMPLING_EPS, 1.0, md.temperature)
    logits = apply_min_p(logits / temperature[:, None], md.min_p)
    top_k_top_p = lambda x: apply_top_k_top_p(x, md.top_k, md.top_p)  # noqa: E731
    if stages == "cond":
        logits = jax.lax.cond(md.any_top_k_top_p, top_k_top_p, lambda x: x, logits)
    elif stages == "all":
        logits = top_k_top_p(logits)
    return gumbel_max(logits, request_keys(md.seeds, md.output_index))


def mask_ids(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Sets logits[i, ids[i, j]] to -inf for ids [S, K]; -1 entries are padding."""
    vocab_size = logits.shape[-1]
    ids = jnp.where(ids < 0, vocab_size, ids)  # out of range: dropped by the scatter
    rows = jnp.broadcast_to(jnp.arange(ids.shape[0])[:, None], ids.shape)
    return logits.at[rows, ids].set(-jnp.inf, mode="drop")


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drops tokens whose probability is below min_p [S] times the row's top probability, as a
    threshold on the logits (p >= min_p p_max <=> logit - max logit >= log min_p): a softmax's
    exponentials and sum would cost two more passes over [S, V]. min_p 0 keeps every token."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(logits - top >= jnp.log(min_p)[:, None], logits, -jnp.inf)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k (k [S], 0 = off), then top-p (p [S], 1 = off) on the top-k-renormalised
    distribution, as vLLM's apply_top_k_top_p. Each filter becomes a per-row logit threshold,
    so the mask is applied in vocab order without a scatter."""
    vocab_size = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)  # [S, V] descending
    k = jnp.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    kth_logit = jnp.take_along_axis(sorted_logits, k[:, None] - 1, axis=-1)
    sorted_logits = jnp.where(sorted_logits >= kth_logit, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Mass of the strictly better tokens; a token is in the nucleus while that is below p.
    cumulative = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], -1)
    keep = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)) & (sorted_logits > -jnp.inf)
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # a prefix of the sorted row
    threshold = jnp.take_along_axis(sorted_logits, num_keep[:, None] - 1, axis=-1)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def request_keys(seeds: jax.Array, output_index: jax.Array) -> jax.Array:
    """One PRNG key per row from its seed and the number of tokens it has generated."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, output_index)


def gumbel_max(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """argmax(logits + Gumbel noise) per row: an exact draw from softmax(logits)."""
    vocab_size = logits.shape[-1]
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab_size,), jnp.float32))(keys)
    return jnp.argmax(logits + noise, axis=-1).astype(jnp.int32)
