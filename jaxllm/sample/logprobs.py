"""Top-N logprobs of a set of positions plus the logprob and rank of one chosen token each.

Used for sampled tokens (row = sequence, token = the sampled id) and for prompt logprobs
(row = prompt position, token = the next prompt token). Values come from the raw model logits'
log_softmax, as vLLM V1's default logprobs mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclass
class LogprobsTensors:
    top_ids: jax.Array  # [N, MAX_LOGPROBS] i32, best first
    top_logprobs: jax.Array  # [N, MAX_LOGPROBS] f32
    sampled_logprob: jax.Array  # [N] f32: logprob of the chosen token
    sampled_rank: jax.Array  # [N] i32: tokens at least as likely as the chosen one (1 = argmax)


def gather_logprobs(logits: jax.Array, token_ids: jax.Array) -> LogprobsTensors:
    """logits [N, V] f32, token_ids [N] i32. The rank counts tokens with logprob >= the chosen
    one's (vLLM's convention: 1 for the argmax, ties share the worse rank)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    sampled_logprob = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    sampled_rank = jnp.sum(logprobs >= sampled_logprob[:, None], axis=-1, dtype=jnp.int32)
    return LogprobsTensors(top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs,
                           sampled_logprob=sampled_logprob, sampled_rank=sampled_rank)


def empty_logprobs(num_rows: int) -> LogprobsTensors:
    return LogprobsTensors(top_ids=jnp.zeros((num_rows, MAX_LOGPROBS), jnp.int32),
                           top_logprobs=jnp.zeros((num_rows, MAX_LOGPROBS), jnp.float32),
                           sampled_logprob=jnp.zeros((num_rows,), jnp.float32),
                           sampled_rank=jnp.zeros((num_rows,), jnp.int32))


def chunked_logprobs(logits_fn, hidden: jax.Array, token_ids: jax.Array,
                     chunk: int = 128) -> LogprobsTensors:
    """gather_logprobs(logits_fn(hidden), token_ids) for many rows (prompt logprobs: one row per
    token of the step), `chunk` rows at a time so the [rows, V] logits never exist at once."""
    num_rows = hidden.shape[0]
    chunk = min(chunk, num_rows)
    pad = -num_rows % chunk
    hidden = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[-1])
    token_ids = jnp.pad(token_ids, (0, pad)).reshape(-1, chunk)
    out = jax.lax.map(lambda xs: gather_logprobs(logits_fn(xs[0]), xs[1]), (hidden, token_ids))
    return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[:num_rows], out)
