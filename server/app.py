"""The Starlette app: routes, API-key auth, and OpenAI error bodies for every failure."""

from __future__ import annotations

import asyncio
import hmac
import logging
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from jaxllm.server.errors import OpenAIError, decode_request, error_response
from jaxllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                             DetokenizeResponse, TokenizeRequest, TokenizeResponse)
from jaxllm.server.serving import OpenAIServing
from jaxllm.server.serving_chat import ChatServing, render_chat
from jaxllm.server.serving_completion import CompletionServing
from jaxllm.server.serving_pooling import pooling_routes, require_generative

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 1024 * 1024
_ENCODER = msgspec.json.Encoder()


def _json(body) -> Response:
    return Response(_ENCODER.encode(body), media_type="application/json")


async def _read_body(request: Request) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise OpenAIError(f"Request body exceeds {MAX_BODY_BYTES} bytes.",
                              HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        chunks.append(chunk)
    return b"".join(chunks)


async def _until_disconnect(request: Request, work) -> Response:
    """Runs `work` (a coroutine), cancelling it (and so aborting its requests) if the client
    leaves first; a disconnected client gets no response, so any placeholder will do."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            logger.info("Client disconnected: request cancelled")
            return Response(status_code=499)
    return task.result()


def build_app(serving: OpenAIServing, api_key: str | None = None) -> Starlette:
    completions, chat = CompletionServing(serving), ChatServing(serving)

    async def create_completion(request: Request) -> Response:
        require_generative(serving, "/v1/completions")
        body = decode_request(await _read_body(request), CompletionRequest)
        return await _until_disconnect(request, completions.create(body))

    async def create_chat_completion(request: Request) -> Response:
        require_generative(serving, "/v1/chat/completions")
        body = decode_request(await _read_body(request), ChatCompletionRequest)
        return await _until_disconnect(request, chat.create(body))

    async def tokenize(request: Request) -> Response:
        body = decode_request(await _read_body(request), TokenizeRequest)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("Exactly one of prompt and messages must be given.")
        if body.messages is not None:
            _, tokens = render_chat(serving, body.messages, body.add_generation_prompt)
        else:
            tokens = serving.require_tokenizer("prompt").encode(
                body.prompt, add_special_tokens=body.add_special_tokens)
        return _json(TokenizeResponse(tokens, len(tokens), serving.max_model_len))

    async def detokenize(request: Request) -> Response:
        body = decode_request(await _read_body(request), DetokenizeRequest)
        serving.check_model(body.model)
        tokenizer = serving.require_tokenizer("tokens")
        vocab = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"Token id {bad[0]} is out of vocabulary (vocab size {vocab}).",
                              param="tokens")
        return _json(DetokenizeResponse(tokenizer.decode(body.tokens)))

    async def models(request: Request) -> Response:
        return _json(serving.models())

    async def health(request: Request) -> Response:
        return Response(status_code=200 if serving.engine.is_healthy else 503)

    async def get_version(request: Request) -> Response:
        return _json({"version": _package_version()})

    async def metrics(request: Request) -> Response:
        return serving.metrics.render(serving.engine.get_stats())

    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's: 200 once every cached prefix is forgotten, 409 while requests hold KV."""
        if request.query_params.get("reset_running_requests", "false").lower() != "false":
            raise OpenAIError("reset_running_requests is not supported.",
                              param="reset_running_requests")
        if not await serving.engine.reset_prefix_cache():
            raise OpenAIError("Prefix cache reset failed.", HTTPStatus.CONFLICT)
        return Response(status_code=200)

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", get_version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        *pooling_routes(serving, _read_body, _until_disconnect),
    ]
    app = Starlette(routes=routes, exception_handlers={
        OpenAIError: _openai_error,
        HTTPException: _http_error,
        Exception: _internal_error,
    })
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


async def _openai_error(request: Request, error: OpenAIError) -> Response:
    return error_response(error)


async def _http_error(request: Request, error: HTTPException) -> Response:
    return error_response(OpenAIError(error.detail, HTTPStatus(error.status_code)))


async def _internal_error(request: Request, error: Exception) -> Response:
    logger.exception("Unhandled error", exc_info=error)
    return error_response(OpenAIError(f"Internal server error: {error!r}",
                                      HTTPStatus.INTERNAL_SERVER_ERROR))


class ApiKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <key>`, compared in constant time."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(OpenAIError(
                    "Unauthorized: a valid API key is required.", HTTPStatus.UNAUTHORIZED))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _package_version() -> str:
    try:
        return version("jaxllm")
    except PackageNotFoundError:
        return "unknown"
