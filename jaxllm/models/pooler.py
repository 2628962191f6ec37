"""Pooling (vLLM's Pooler): hidden states of padded rows -> one vector per sequence, and the
classifier heads of *ForSequenceClassification models. What depends on the request (Matryoshka
truncation, normalisation, softmax) is applied on the host (engine/pooling_engine.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pool(hidden: jax.Array, lengths: jax.Array, pooling_type: str) -> jax.Array:
    """hidden [S, L, H], lengths [S] -> [S, H] float32 (CLS: the first token, LAST: the last,
    MEAN: the mean over each row's tokens), or for ALL every token [S, L, H]."""
    hidden = hidden.astype(jnp.float32)
    if pooling_type == "CLS":
        return hidden[:, 0]
    if pooling_type == "LAST":
        return hidden[jnp.arange(hidden.shape[0]), lengths - 1]
    if pooling_type == "MEAN":
        mask = jnp.arange(hidden.shape[1])[None, :] < lengths[:, None]
        total = jnp.einsum("slh,sl->sh", hidden, mask.astype(jnp.float32))
        return total / lengths[:, None].astype(jnp.float32)
    if pooling_type == "ALL":
        return hidden
    raise ValueError(f"Unknown pooling_type {pooling_type!r}.")


def classifier_head(params: dict, pooled: jax.Array) -> jax.Array:
    """pooled [S, H] -> class logits [S, labels] float32: BERT's pooler (dense + tanh) then its
    classifier, RoBERTa's dense + tanh then out_proj, or a decoder's bias-free `score`."""
    x = pooled
    if "head_dense_w" in params:
        x = jnp.tanh(x @ params["head_dense_w"].astype(jnp.float32) + params["head_dense_b"])
    logits = x @ params["classifier_w"].astype(jnp.float32)
    return logits + params["classifier_b"] if "classifier_b" in params else logits


def pooling_forward(params: dict, token_ids: jax.Array, token_type_ids: jax.Array,
                    lengths: jax.Array, lora_slots: jax.Array | None = None, *, hidden_fn,
                    pooling_type: str, classify: bool) -> jax.Array:
    """A pooling model's step: hidden_fn(params, token_ids, token_type_ids, lengths, lora_slots)
    -> [S, L, H] (an encoder, or a decoder through models/padded_attention.py), pooled, and
    through the classifier head for a classifier: [S, H], [S, labels] or (ALL) [S, L, H],
    float32. lora_slots [S]: each row's LoRA adapter slot (None: LoRA off)."""
    hidden = hidden_fn(params, token_ids, token_type_ids, lengths, lora_slots)
    pooled = pool(hidden, lengths, pooling_type)
    return classifier_head(params, pooled) if classify else pooled
