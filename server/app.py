"""The Starlette app: routes, API-key auth, and OpenAI error bodies for every failure."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import resource
import signal
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version

import h11
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from jaxllm.engine.input_processor import InputError
from jaxllm.server.errors import INTERNAL_ERROR, OpenAIError, decode_request, error_response
from jaxllm.server.lora_models import runtime_updating_allowed
from jaxllm.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   DetokenizeResponse, LoadLoRAAdapterRequest, TokenizeRequest,
                                   TokenizeResponse, UnloadLoRAAdapterRequest)
from jaxllm.server.serving import OpenAIServing
from jaxllm.server.serving_chat import ChatServing, render_chat
from uvicorn.protocols.http.h11_impl import H11Protocol
from jaxllm.server.serving_completion import CompletionServing
from jaxllm.server.serving_pooling import pooling_routes, require_generative

logger = logging.getLogger(__name__)
_ENCODER = msgspec.json.Encoder()

# Server limits; `jaxllm serve` exposes each as a flag of the same name.
# A body bound keeps one request's tokenising bounded (vLLM has none; a prompt at a 128k context
# is well under 1 MiB of text).
MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# Open connections (and requests) past which uvicorn answers 503.
LIMIT_CONCURRENCY = 2048
# Seconds a connection may stay idle, before its first request as well as between requests.
TIMEOUT_KEEP_ALIVE = 5
# Bytes of an unfinished request head (h11); vLLM's --h11-max-incomplete-event-size default.
H11_MAX_INCOMPLETE_EVENT_SIZE = 4 * 1024 * 1024
# Seconds a request head may take from its first byte, and a body from the end of its head (vLLM
# and uvicorn have no bound): a client that trickles either in would hold its connection, and a
# concurrency slot, for as long as it likes.
REQUEST_HEADER_TIMEOUT = 30.0
REQUEST_BODY_TIMEOUT = 30.0
# Seconds between checks that the engine thread is alive.
_WATCHDOG_PERIOD_S = 0.5


def _json(body) -> Response:
    return Response(_ENCODER.encode(body), media_type="application/json")


class _SlowBody(OpenAIError):
    """A body that did not arrive in time: answered 408, then the connection closes rather than
    wait for the rest."""


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body: at most `limit` bytes, within `timeout` seconds."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise OpenAIError(f"Request body exceeds {limit} bytes.",
                                      HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
                chunks.append(chunk)
    except TimeoutError:
        raise _SlowBody(f"The request body did not arrive within {timeout:g} seconds.",
                        HTTPStatus.REQUEST_TIMEOUT) from None
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


def build_app(serving: OpenAIServing, api_key: str | None = None,
              max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES,
              on_engine_dead=None, enable_tokenizer_info_endpoint: bool = False,
              request_body_timeout: float = REQUEST_BODY_TIMEOUT) -> Starlette:
    """The app. When the engine thread dies, `on_engine_dead()` runs (default: the process
    stops with a non-zero status, as vLLM's, so that a supervisor restarts it)."""

    async def body(request: Request, request_type):
        """The request's body, bounded and decoded into request_type."""
        return decode_request(await _read_body(request, max_request_body_bytes,
                                               request_body_timeout), request_type)

    routes = [*_generation_routes(serving, body),
              *_info_routes(serving, enable_tokenizer_info_endpoint),
              *(_lora_routes(serving, body)
                if serving.adapters is not None and runtime_updating_allowed() else []),
              *pooling_routes(serving, body, _until_disconnect)]
    app = Starlette(routes=routes, lifespan=_watchdog(serving, on_engine_dead or _exit_non_zero),
                    exception_handlers=_EXCEPTION_HANDLERS)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def _generation_routes(serving: OpenAIServing, body) -> list[Route]:
    completions, chat = CompletionServing(serving), ChatServing(serving)

    async def create_completion(request: Request) -> Response:
        require_generative(serving, "/v1/completions")
        completion = await body(request, CompletionRequest)
        return await _until_disconnect(request, completions.create(completion))

    async def create_chat_completion(request: Request) -> Response:
        require_generative(serving, "/v1/chat/completions")
        chat_request = await body(request, ChatCompletionRequest)
        return await _until_disconnect(request, chat.create(chat_request))

    async def tokenize(request: Request) -> Response:
        return _json(await _tokenize(serving, await body(request, TokenizeRequest)))

    async def detokenize(request: Request) -> Response:
        return _json(await _detokenize(serving, await body(request, DetokenizeRequest)))

    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's: 200 once every cached prefix is forgotten, 409 while requests hold KV."""
        if request.query_params.get("reset_running_requests", "false").lower() != "false":
            raise OpenAIError("reset_running_requests is not supported.",
                              param="reset_running_requests")
        if not await serving.engine.reset_prefix_cache():
            raise OpenAIError("Prefix cache reset failed.", HTTPStatus.CONFLICT)
        return Response(status_code=200)

    return [Route("/v1/completions", create_completion, methods=["POST"]),
            Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])]


def _lora_routes(serving: OpenAIServing, body) -> list[Route]:
    """vLLM's runtime LoRA updating (only when allowed by its environment variable)."""
    async def load(request: Request) -> Response:
        message = await serving.load_lora_adapter(await body(request, LoadLoRAAdapterRequest))
        return PlainTextResponse(message)

    async def unload(request: Request) -> Response:
        message = await serving.unload_lora_adapter(await body(request, UnloadLoRAAdapterRequest))
        return PlainTextResponse(message)

    return [Route("/v1/load_lora_adapter", load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload, methods=["POST"])]


def _info_routes(serving: OpenAIServing, tokenizer_info_endpoint: bool) -> list[Route]:
    async def models(request: Request) -> Response:
        return _json(serving.models())

    async def model(request: Request) -> Response:
        return _json(serving.model(request.path_params["model_id"]))

    async def tokenizer_info(request: Request) -> Response:
        return _json(serving.tokenizer_info())

    async def health(request: Request) -> Response:
        return Response(status_code=200 if serving.engine.is_healthy else 503)

    async def get_version(request: Request) -> Response:
        return _json({"version": _package_version()})

    async def metrics(request: Request) -> Response:
        return serving.metrics.render(serving.engine.get_stats())

    return [Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            *([Route("/tokenizer_info", tokenizer_info, methods=["GET"])]
              if tokenizer_info_endpoint else []),
            Route("/health", health, methods=["GET"]),
            Route("/version", get_version, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"])]


async def _tokenize(serving: OpenAIServing, request: TokenizeRequest) -> TokenizeResponse:
    """/tokenize: the same input thread and body bound as generation, so no cheaper path."""
    serving.check_model(request.model)
    if (request.prompt is None) == (request.messages is None):
        raise OpenAIError("Exactly one of prompt and messages must be given.")
    if request.messages is not None:
        prompt = await render_chat(serving, request.messages, request.add_generation_prompt)
    else:
        serving.require_tokenizer("prompt")
        prompt = await serving.off_loop(serving.processor.from_text, request.prompt,
                                        request.add_special_tokens)
    return TokenizeResponse(prompt.token_ids, len(prompt.token_ids), serving.max_model_len)


async def _detokenize(serving: OpenAIServing, request: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(request.model)
    serving.require_tokenizer("tokens")
    return DetokenizeResponse(await serving.off_loop(serving.processor.detokenize,
                                                     request.tokens))


def _watchdog(serving: OpenAIServing, on_engine_dead):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def watch() -> None:
            while serving.engine.is_healthy:
                await asyncio.sleep(_WATCHDOG_PERIOD_S)
            logger.critical("The engine loop died; stopping the server.")
            on_engine_dead()

        task = asyncio.create_task(watch())
        try:
            yield
        finally:
            task.cancel()
    return lifespan


def _exit_non_zero() -> None:
    # uvicorn shuts down on SIGTERM, then re-raises it: the process ends killed by SIGTERM.
    signal.raise_signal(signal.SIGTERM)


def uvicorn_config(app, host: str, port: int, log_level: str = "info",
                   limit_concurrency: int | None = LIMIT_CONCURRENCY,
                   timeout_keep_alive: int = TIMEOUT_KEEP_ALIVE,
                   h11_max_incomplete_event_size: int = H11_MAX_INCOMPLETE_EVENT_SIZE,
                   request_header_timeout: float = REQUEST_HEADER_TIMEOUT,
                   request_body_timeout: float = REQUEST_BODY_TIMEOUT,
                   **options) -> uvicorn.Config:
    """uvicorn's settings for the app, with this server's connection limits; options: any
    other uvicorn.Config setting (TLS, root path, access log)."""
    _raise_open_files_limit()
    protocol = functools.partial(_H11Protocol, request_header_timeout=request_header_timeout,
                                 request_body_timeout=request_body_timeout)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          limit_concurrency=limit_concurrency,
                          timeout_keep_alive=timeout_keep_alive,
                          h11_max_incomplete_event_size=h11_max_incomplete_event_size, **options)


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol, but no client holds a connection by sending slowly or not at all,
    so connections cannot pile up until the process runs out of file descriptors or
    limit_concurrency: one that sends nothing is closed after the keep-alive timeout too (uvicorn
    starts that timer only after a first response); a request head must be complete within
    request_header_timeout of its first byte (h11 bounds its size, not its time); a body still
    coming in after its response was sent (a route that did not read it) is waited for at most
    request_body_timeout. The body a route reads is bounded by the app (_read_body)."""

    def __init__(self, *args, request_header_timeout: float, request_body_timeout: float,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timeouts = {"head": request_header_timeout, "unread body": request_body_timeout}
        self._slow_phase: str | None = None  # what the armed deadline waits for
        self._slow_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_slow_client()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_slow_client()

    def connection_lost(self, exc) -> None:
        self._arm_deadline(None)
        super().connection_lost(exc)

    def _watch_slow_client(self) -> None:
        """Arms a deadline when a head has started or a body is left coming in after its
        response; disarms it when neither is the case any more."""
        conn = self.conn
        if conn.their_state is h11.IDLE and conn.trailing_data[0]:
            phase = "head"
        elif (conn.their_state is h11.SEND_BODY and self.cycle is not None
              and self.cycle.response_complete):
            phase = "unread body"
        else:
            phase = None
        if phase != self._slow_phase:
            self._arm_deadline(phase)

    def _arm_deadline(self, phase: str | None) -> None:
        if self._slow_deadline is not None:
            self._slow_deadline.cancel()
        self._slow_phase = phase
        self._slow_deadline = (None if phase is None else self.loop.call_later(
            self._timeouts[phase], self._close_slow_client))

    def _close_slow_client(self) -> None:
        logger.info("Closed a connection whose %s did not arrive within %g seconds.",
                    self._slow_phase, self._timeouts[self._slow_phase])
        self._slow_deadline = None
        self.timeout_keep_alive_handler()  # closes the connection


def _raise_open_files_limit() -> None:
    """As vLLM: the soft limit on open files up to the hard one, for many connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _openai_error(request: Request, error: OpenAIError) -> Response:
    return error_response(error)


async def _slow_body(request: Request, error: _SlowBody) -> Response:
    response = error_response(error)
    response.headers["connection"] = "close"  # h11 then closes the connection after it
    return response


async def _input_error(request: Request, error: InputError) -> Response:
    return error_response(OpenAIError(str(error), param=error.param))


async def _http_error(request: Request, error: HTTPException) -> Response:
    return error_response(OpenAIError(error.detail, HTTPStatus(error.status_code)))


async def _internal_error(request: Request, error: Exception) -> Response:
    logger.exception("Unhandled error", exc_info=error)
    return error_response(OpenAIError(INTERNAL_ERROR, HTTPStatus.INTERNAL_SERVER_ERROR))


_EXCEPTION_HANDLERS = {
    OpenAIError: _openai_error,
    _SlowBody: _slow_body,
    InputError: _input_error,
    HTTPException: _http_error,
    Exception: _internal_error,
}


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
