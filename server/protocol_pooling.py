"""Request and response schemas of the pooling endpoints, as vLLM's (OpenAI's /v1/embeddings;
/classify, /score, /rerank in Jina/Cohere's shape, /pooling)."""

from __future__ import annotations

import time
from typing import Literal

import msgspec

# A string, a list of strings, token ids, or a list of token-id lists (checked after decoding,
# as msgspec allows one array type per union).
PoolingInput = str | list[str | int | list[int]]


class _PoolingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's extension; -1: max_model_len


class EmbeddingRequest(_PoolingFields, kw_only=True):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's extension


class ClassificationRequest(_PoolingFields, kw_only=True):
    input: PoolingInput
    use_activation: bool | None = None


class PoolingRequest(_PoolingFields, kw_only=True):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"


class ScoreRequest(_PoolingFields, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields, kw_only=True):
    query: str
    documents: list[str]
    top_n: int = 0  # 0: every document
    return_documents: bool = True


def _now() -> int:
    return int(time.time())


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct):
    id: str
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: str = "list"
    created: int = msgspec.field(default_factory=_now)


class ClassificationData(msgspec.Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int
    object: str = "classification"


class ClassificationResponse(msgspec.Struct):
    id: str
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: str = "list"
    created: int = msgspec.field(default_factory=_now)


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"
    created: int = msgspec.field(default_factory=_now)


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class PoolingData(msgspec.Struct):
    index: int
    data: list | str  # a vector, per-token vectors, or base64
    object: str = "pooling"


class PoolingResponse(msgspec.Struct):
    id: str
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"
    created: int = msgspec.field(default_factory=_now)
