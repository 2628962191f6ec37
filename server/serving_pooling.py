"""The pooling endpoints: /v1/embeddings, /classify, /score, /rerank (and /v1/rerank, /v2/rerank),
/pooling; and the 400 a generation request gets from a pooling model, or the reverse."""

from __future__ import annotations

import asyncio
import base64
import uuid

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxllm.engine.pooling_engine import PoolingEngine
from jaxllm.engine.pooling_inputs import (cosine, cross_encoder_score, pair_inputs, pair_params,
                                          prompt_token_ids, score_pairs, truncation_length)
from jaxllm.outputs import PoolingRequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.server.errors import OpenAIError
from jaxllm.server.protocol_pooling import (
    ClassificationData, ClassificationRequest, ClassificationResponse, EmbeddingData,
    EmbeddingRequest, EmbeddingResponse, PoolingData, PoolingRequest, PoolingResponse,
    PoolingUsage, RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage,
    ScoreData, ScoreRequest, ScoreResponse)
from jaxllm.server.serving import OpenAIServing, _as_openai_error

MAX_INPUTS = 2048
_ENCODER = msgspec.json.Encoder()


def is_pooling(serving: OpenAIServing) -> bool:
    return isinstance(serving.engine.core, PoolingEngine)


def require_generative(serving: OpenAIServing, endpoint: str) -> None:
    """The 400 a generation endpoint answers on a pooling model."""
    if is_pooling(serving):
        raise OpenAIError(f"The model does not support {endpoint}: it is a pooling model "
                          f"(--runner pooling); use /v1/embeddings, /classify, /score, /rerank "
                          f"or /pooling.")


class PoolingServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.max_model_len = serving.max_model_len

    def _check(self, model: str | None, endpoint: str):
        """-> (the served name, the LoRA adapter `model` names or None)."""
        name = self.serving.check_model(model)
        if not is_pooling(self.serving):
            raise OpenAIError(f"The model does not support {endpoint}: it is a generative model; "
                              f"serve a pooling model (--runner pooling).")
        return name, self.serving.lora_for(model)

    # -- inputs ---------------------------------------------------------------------------------
    def _token_ids(self, inputs, truncate: int | None, operation: str) -> list[list[int]]:
        """One token-id list per input (the union msgspec cannot express is checked here)."""
        max_length = self._truncation(truncate)
        if isinstance(inputs, str) or (inputs and all(type(x) is int for x in inputs)):
            inputs = [inputs]
        if not inputs:
            raise OpenAIError("input cannot be empty.", param="input")
        if len(inputs) > MAX_INPUTS:
            raise OpenAIError(f"At most {MAX_INPUTS} inputs per request, got {len(inputs)}.",
                              param="input")
        if len({type(x) for x in inputs}) != 1 or type(inputs[0]) is int:
            raise OpenAIError("input must be a string, a list of strings, a list of token ids "
                              "or a list of token-id lists.", param="input")
        tokenizer = (self.serving.require_tokenizer("input") if isinstance(inputs[0], str)
                     else None)
        token_ids = [prompt_token_ids(tokenizer, x, max_length) for x in inputs]
        for ids in token_ids:
            self._check_length(len(ids), operation)
        return token_ids

    def _truncation(self, truncate: int | None) -> int | None:
        try:
            return truncation_length(truncate, self.max_model_len)
        except ValueError as error:
            raise OpenAIError(str(error), param="truncate_prompt_tokens") from None

    def _check_length(self, num_tokens: int, operation: str) -> None:
        if num_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_tokens} tokens in the input for {operation}. Please reduce "
                f"the length of the input.")

    async def _run(self, token_ids: list[list[int]], params: list[PoolingParams],
                   kind: str, lora_request=None) -> list[PoolingRequestOutput]:
        """Submits every input and waits for all (a client that leaves cancels and aborts)."""
        request_id = f"{kind}-{uuid.uuid4().hex}"

        async def one(index: int) -> PoolingRequestOutput:
            async for output in self.serving.engine.generate(
                    token_ids[index], params[index], f"{request_id}-{index}",
                    lora_request=lora_request):
                last = output
            return last

        results = await asyncio.gather(*(one(i) for i in range(len(token_ids))),
                                       return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise _as_openai_error(error)
        return results

    # -- endpoints ------------------------------------------------------------------------------
    async def embeddings(self, request: EmbeddingRequest) -> Response:
        model, lora = self._check(request.model, "/v1/embeddings")
        token_ids = self._token_ids(request.input, request.truncate_prompt_tokens,
                                    "embedding generation")
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize,
                               task="embed")
        outputs = await self._run(token_ids, [params] * len(token_ids), "embd", lora)
        data = [EmbeddingData(i, _encode(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outputs)]
        return _json(EmbeddingResponse(f"embd-{uuid.uuid4().hex}", model, data, _usage(outputs)))

    async def classify(self, request: ClassificationRequest) -> Response:
        model, lora = self._check(request.model, "/classify")
        token_ids = self._token_ids(request.input, request.truncate_prompt_tokens,
                                    "classification")
        params = PoolingParams(use_activation=request.use_activation, task="classify")
        outputs = await self._run(token_ids, [params] * len(token_ids), "classify", lora)
        labels = self.serving.engine.core.config.model_config.hf_config.get("id2label") or {}
        data = []
        for i, output in enumerate(outputs):
            probs = output.outputs.data.tolist()
            best = int(np.argmax(probs))
            label = labels.get(str(best), f"LABEL_{best}")  # HF's default label names
            data.append(ClassificationData(i, label, probs, len(probs)))
        return _json(ClassificationResponse(f"classify-{uuid.uuid4().hex}", model, data,
                                            _usage(outputs)))

    async def _scores(self, texts_1: list[str], texts_2: list[str], truncate: int | None,
                      param: str, lora) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Cosine similarities of embeddings (an embedding model) or a cross-encoder's outputs
        on the pairs (a classifier), vLLM's 1 x N or N x N pairing."""
        try:
            pairs = score_pairs(texts_1, texts_2)
        except ValueError as error:
            raise OpenAIError(str(error), param=param) from None
        if not pairs:
            raise OpenAIError("Nothing to score.", param=param)
        if self.serving.engine.core.task == "embed":
            token_ids = self._token_ids(texts_1 + texts_2, truncate, "score")
            outputs = await self._run(token_ids, [PoolingParams(task="embed")] * len(token_ids),
                                      "score", lora)
            first, second = outputs[:len(texts_1)], outputs[len(texts_1):]
            return [cosine(first[i].outputs.data, second[j].outputs.data)
                    for i, j in pairs], outputs
        tokenizer = self.serving.require_tokenizer(param)
        inputs = [pair_inputs(tokenizer, texts_1[i], texts_2[j], self._truncation(truncate))
                  for i, j in pairs]
        for ids, _ in inputs:
            self._check_length(len(ids), "score")
        outputs = await self._run([ids for ids, _ in inputs],
                                  [pair_params(None, start) for _, start in inputs], "score",
                                  lora)
        try:
            return [cross_encoder_score(o.outputs.data) for o in outputs], outputs
        except ValueError as error:
            raise OpenAIError(str(error)) from None

    async def score(self, request: ScoreRequest) -> Response:
        model, lora = self._check(request.model, "/score")
        as_list = lambda x: [x] if isinstance(x, str) else x  # noqa: E731
        scores, outputs = await self._scores(as_list(request.text_1), as_list(request.text_2),
                                             request.truncate_prompt_tokens, "text_2", lora)
        data = [ScoreData(i, s) for i, s in enumerate(scores)]
        return _json(ScoreResponse(f"score-{uuid.uuid4().hex}", model, data, _usage(outputs)))

    async def rerank(self, request: RerankRequest) -> Response:
        model, lora = self._check(request.model, "/rerank")
        if request.top_n < 0:
            raise OpenAIError(f"top_n must be at least 0, got {request.top_n}.", param="top_n")
        scores, outputs = await self._scores([request.query], request.documents,
                                             request.truncate_prompt_tokens, "documents", lora)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        order = order[:request.top_n] if request.top_n else order
        results = [RerankResult(i, scores[i], RerankDocument(request.documents[i])
                                if request.return_documents else None) for i in order]
        return _json(RerankResponse(f"rerank-{uuid.uuid4().hex}", model,
                                    RerankUsage(_usage(outputs).total_tokens), results))

    async def pooling(self, request: PoolingRequest) -> Response:
        model, lora = self._check(request.model, "/pooling")
        token_ids = self._token_ids(request.input, request.truncate_prompt_tokens, "pooling")
        params = PoolingParams(task="encode")
        outputs = await self._run(token_ids, [params] * len(token_ids), "pool", lora)
        data = [PoolingData(i, _encode(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outputs)]
        return _json(PoolingResponse(f"pool-{uuid.uuid4().hex}", model, data, _usage(outputs)))


def _encode(values: np.ndarray, encoding_format: str) -> list | str:
    """OpenAI's encodings: a JSON list, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode("ascii")
    return values.tolist()


def _usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _json(body) -> Response:
    return Response(_ENCODER.encode(body), media_type="application/json")


def pooling_routes(serving: OpenAIServing, read_request, until_disconnect) -> list[Route]:
    """The pooling endpoints; read_request (the body, bounded and decoded) and until_disconnect
    are the app's (server/app.py)."""
    pooling = PoolingServing(serving)

    def route(path: str, request_type, handler) -> Route:
        async def endpoint(request: Request) -> Response:
            body = await read_request(request, request_type)
            return await until_disconnect(request, handler(body))
        return Route(path, endpoint, methods=["POST"])

    return [route("/v1/embeddings", EmbeddingRequest, pooling.embeddings),
            route("/classify", ClassificationRequest, pooling.classify),
            route("/score", ScoreRequest, pooling.score),
            route("/v1/score", ScoreRequest, pooling.score),
            route("/rerank", RerankRequest, pooling.rerank),
            route("/v1/rerank", RerankRequest, pooling.rerank),
            route("/v2/rerank", RerankRequest, pooling.rerank),
            route("/pooling", PoolingRequest, pooling.pooling)]
