"""What the engine hands back to users, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated (or prompt) position: token id -> Logprob (the chosen token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


class _PromptIds:
    """vLLM's prompt_token_ids list, made from the engine's array (numpy, or the C ints a
    generating request keeps) when first read: the conversion costs as much host time per
    token as the rest of a pooling request, and a list held while a request runs is one more
    thing for every full garbage collection to walk."""
    _prompt_token_ids: list[int] | np.ndarray | array

    @property
    def prompt_token_ids(self) -> list[int]:
        if not isinstance(self._prompt_token_ids, list):
            self._prompt_token_ids = self._prompt_token_ids.tolist()
        return self._prompt_token_ids


@dataclass
class RequestOutput(_PromptIds):
    request_id: str
    prompt: str | None
    _prompt_token_ids: list[int] | array
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    metrics: dict = field(default_factory=dict)
    # Prompt tokens found in the prefix cache at admission (n > 1: the first sample's); None
    # before the request was first scheduled.
    num_cached_tokens: int | None = None


# -- pooling models (vLLM's PoolingRequestOutput and its task-specific views) -------------------
@dataclass
class PoolingOutput:
    data: np.ndarray  # the pooler's output: an embedding, class probabilities, or per-token


@dataclass
class PoolingRequestOutput(_PromptIds):
    request_id: str
    outputs: PoolingOutput
    _prompt_token_ids: list[int] | np.ndarray
    finished: bool = True


class _ListOnRead:
    """vLLM's list-of-floats field, made from the pooled array when first read: converting
    every row of a large offline batch cost more host time than the GPU's forward."""

    def __init__(self, values) -> None:
        self._values = values  # np.ndarray until read

    def _list(self) -> list[float]:
        if not isinstance(self._values, list):
            self._values = self._values.tolist()
        return self._values

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self._list() == other._list()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._list()!r})"


class EmbeddingOutput(_ListOnRead):
    @property
    def embedding(self) -> list[float]:
        return self._list()

    @property
    def hidden_size(self) -> int:
        return len(self._values)


class ClassificationOutput(_ListOnRead):
    @property
    def probs(self) -> list[float]:
        return self._list()

    @property
    def num_classes(self) -> int:
        return len(self._values)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput(_PromptIds):
    request_id: str
    outputs: EmbeddingOutput
    _prompt_token_ids: list[int] | np.ndarray
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data),
                   output._prompt_token_ids, output.finished)


@dataclass
class ClassificationRequestOutput(_PromptIds):
    request_id: str
    outputs: ClassificationOutput
    _prompt_token_ids: list[int] | np.ndarray
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(output.request_id, ClassificationOutput(output.outputs.data),
                   output._prompt_token_ids, output.finished)


@dataclass
class ScoringRequestOutput(_PromptIds):
    request_id: str
    outputs: ScoringOutput
    _prompt_token_ids: list[int] | np.ndarray
    finished: bool = True
