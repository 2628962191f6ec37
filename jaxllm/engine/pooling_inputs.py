"""Prompts of pooling requests as token ids (truncated as vLLM's truncate_prompt_tokens), sentence
pairs for cross-encoders, and the scores of the score/rerank APIs. Shared by LLM and the server."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxllm.pooling_params import PoolingParams


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """-1 means max_model_len; a value above it is vLLM's error."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({truncate_prompt_tokens}) is greater "
                         f"than max_model_len ({max_model_len}). Please, select a smaller "
                         f"truncation size.")
    if truncate_prompt_tokens < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got "
                         f"{truncate_prompt_tokens}.")
    return truncate_prompt_tokens


def prompt_token_ids(tokenizer, prompt: str | list[int] | dict[str, Any],
                     max_length: int | None) -> np.ndarray:
    """-> the prompt's token ids as a 1-D integer array (a batch's prompts are then copied
    and checked by numpy, not token by token in Python). A text is tokenised with the model's
    special tokens (truncated by the tokenizer, which keeps them); token ids keep their last
    max_length (as vLLM)."""
    if isinstance(prompt, dict):
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("This model has no tokenizer: give prompts as token ids.")
        if max_length is None:
            return np.asarray(tokenizer(prompt)["input_ids"], np.int64)
        return np.asarray(tokenizer(prompt, truncation=True, max_length=max_length)["input_ids"],
                          np.int64)
    try:
        ids = np.fromiter(prompt, np.int64, len(prompt))
    except (TypeError, ValueError, OverflowError):
        raise ValueError("A prompt must be a text or a list of integer token ids.") from None
    return ids[-max_length:] if max_length is not None else ids


def pair_inputs(tokenizer, text_1: str, text_2: str,
                max_length: int | None) -> tuple[list[int], int | None]:
    """A cross-encoder's input: (token ids of the pair, where its second segment's token type
    starts, None if the tokenizer has no token types)."""
    if tokenizer is None:
        raise ValueError("Scoring sentence pairs needs the model's tokenizer.")
    encoded = tokenizer(text_1, text_2, truncation=max_length is not None, max_length=max_length)
    types = encoded.get("token_type_ids")
    start = types.index(1) if types and 1 in types else None
    return encoded["input_ids"], start


def pair_params(params: PoolingParams | None, token_type_start: int | None) -> PoolingParams:
    base = params or PoolingParams()
    return PoolingParams(truncate_prompt_tokens=base.truncate_prompt_tokens,
                         use_activation=base.use_activation, task="score",
                         token_type_start=token_type_start)


def score_pairs(texts_1: list, texts_2: list) -> list[tuple[int, int]]:
    """vLLM's pairing: 1 x N (the one against each), or N x N (element-wise)."""
    if len(texts_1) == 1:
        return [(0, j) for j in range(len(texts_2))]
    if len(texts_1) != len(texts_2):
        raise ValueError(f"text_1 and text_2 must have the same length, or text_1 length 1; "
                         f"got {len(texts_1)} and {len(texts_2)}.")
    return [(i, i) for i in range(len(texts_1))]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def cross_encoder_score(probs: np.ndarray) -> float:
    """A cross-encoder's one output (sigmoid of its logit)."""
    if probs.size != 1:
        raise ValueError(f"Scoring with a classifier needs a cross-encoder with one output "
                         f"label (num_labels=1); this model has {probs.size}.")
    return float(probs.reshape(-1)[0])
