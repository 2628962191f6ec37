"""Per-request parameters of pooling models, named as vLLM's PoolingParams."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    """Fields left None take the model's defaults (its PoolerConfig)."""
    truncate_prompt_tokens: int | None = None  # keep this many tokens (-1: max_model_len)
    dimensions: int | None = None  # Matryoshka: the first `dimensions` of the embedding
    normalize: bool | None = None  # L2-normalise the embedding
    use_activation: bool | None = None  # softmax (sigmoid for one label) over class logits
    task: str | None = None  # set by the API that sends it: embed | classify | score | encode
    # A sentence pair (cross-encoder scoring): the token position where the second segment
    # starts, i.e. where token_type_ids turn from 0 to 1 (vLLM's compressed token types).
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1, got "
                             f"{self.truncate_prompt_tokens}.")
