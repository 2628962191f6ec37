"""Attention over a padded batch of whole sequences, no KV cache: what pooling models run.

A pooling request is done after one forward over its whole prompt, so nothing is cached and each
sequence attends only to itself. The batch is `[S, L]` rows padded to a length bucket (not the
flat ragged `[T]` of generation): each row's attention is then one dense `[L, L]` block, where a
flat batch would need a `[T, T]` mask whose cost grows with the whole batch (docs/design.md).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jaxllm.models.args import ModelArgs
from jaxllm.models.batch import StepBatch


def padded_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     causal: bool, sm_scale: float, implementation: str | None = None) -> jax.Array:
    """q [S, L, Hq, D], k, v [S, L, Hkv, D] (Hq a multiple of Hkv), lengths [S] >= 1: each row
    attends to its first lengths[s] keys (and, causal, to none after the query). Softmax in fp32.
    implementation: jax.nn.dot_product_attention's (None: XLA; "cudnn": its fused kernel)."""
    dtype = q.dtype
    if dtype == jnp.float16 and jax.default_backend() == "cpu":
        # XLA:CPU has no float16 dot with a float32 result, which the softmax's logits use.
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    out = jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=causal,
                                       key_value_seq_lengths=lengths,
                                       implementation=implementation)
    return out.astype(dtype)


def decoder_hidden(params: dict, token_ids: jax.Array, lengths: jax.Array, *, args: ModelArgs,
                   forward, lora_slots: jax.Array | None = None,
                   implementation: str | None = None) -> jax.Array:
    """A causal decoder's final-normed hidden states [S, L, H] over padded rows token_ids [S, L],
    through the generation model's own `forward`: the padded batch is a ragged batch whose rows
    all start at multiples of L, the "KV cache" each layer writes is just its k and v, and
    attention is padded_attention over those rows. lora_slots [S] (with params["lora"]): each
    row's LoRA adapter slot, 0 for the base model."""
    num_seqs, max_len = token_ids.shape
    positions = jnp.tile(jnp.arange(max_len, dtype=jnp.int32), num_seqs)
    batch = StepBatch(token_ids=token_ids.reshape(-1), positions=positions,
                      slot_mapping=jnp.zeros_like(positions),
                      block_tables=jnp.zeros((num_seqs, 1), jnp.int32),
                      cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32) * max_len,
                      kv_lens=lengths, num_seqs=jnp.array([num_seqs], jnp.int32),
                      logits_indices=jnp.arange(num_seqs, dtype=jnp.int32) * max_len,
                      lora_slots=None if lora_slots is None else jnp.repeat(lora_slots, max_len))
    no_cache = [(None, None)] * args.num_layers
    attn = partial(_attend_rows, implementation=implementation)
    _, _, hidden = forward(params, no_cache, batch, args=args, attn=attn, write_kv=_keep_kv,
                           return_hidden=True)
    return hidden.reshape(num_seqs, max_len, -1)


def _keep_kv(k_cache, v_cache, k, v, slot_mapping):
    return k, v


def _attend_rows(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale,
                 sliding_window=None, implementation=None):
    """The paged-attention signature over decoder_hidden's rows: q [S*L, Hq, D], k, v [S*L, ...]."""
    del block_tables, cu_q_lens, num_seqs, sliding_window  # refused for pooling at load
    rows = kv_lens.shape[0]
    as_rows = lambda x: x.reshape(rows, -1, *x.shape[1:])  # noqa: E731
    out = padded_attention(as_rows(q), as_rows(k), as_rows(v), kv_lens, causal=True,
                           sm_scale=sm_scale, implementation=implementation)
    return out.reshape(q.shape)
