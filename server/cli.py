"""`jaxllm serve`: flags (vLLM's names) and the uvicorn runner."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl

import uvicorn

from jaxllm.engine.args import EngineArgs, add_vllm_compat_flags, refuse
from jaxllm.server.app import (H11_MAX_INCOMPLETE_EVENT_SIZE, LIMIT_CONCURRENCY,
                               MAX_REQUEST_BODY_BYTES, REQUEST_BODY_TIMEOUT,
                               REQUEST_HEADER_TIMEOUT, TIMEOUT_KEEP_ALIVE)
from jaxllm.server.app import uvicorn_config as app_uvicorn_config
from jaxllm.server.lora_models import ServedAdapters, parse_lora_module
from jaxllm.server.metrics import PREFIXES

logger = logging.getLogger("jaxllm.server")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a local HF model directory, a .gguf file, or a dummy preset name "
                             "(default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--model", default=None, help="same as MODEL")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", nargs="+", action=_OneApiKey, metavar="KEY",
                        default=os.environ.get("JAXLLM_API_KEY"),
                        help="require `Authorization: Bearer <key>` on /v1 routes "
                             "(default: $JAXLLM_API_KEY)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one "
                             "(default: the tokenizer's)")
    parser.add_argument("--max-queue-len", type=int, default=None,
                        help="answer 503 while this many sequences (prompts x n) are waiting")
    parser.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve GET /tokenizer_info (off by default, as vLLM)")
    parser.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES,
                        help="answer 413 to a larger request body")
    parser.add_argument("--limit-concurrency", type=int, default=LIMIT_CONCURRENCY,
                        help="open connections at most; past it uvicorn answers 503")
    parser.add_argument("--timeout-keep-alive", type=int, default=TIMEOUT_KEEP_ALIVE,
                        help="seconds an idle connection stays open (before its first request "
                             "too)")
    parser.add_argument("--h11-max-incomplete-event-size", type=int,
                        default=H11_MAX_INCOMPLETE_EVENT_SIZE,
                        help="bytes of an HTTP request head at most (vLLM's flag)")
    parser.add_argument("--request-header-timeout", type=float, default=REQUEST_HEADER_TIMEOUT,
                        help="seconds a request head may take from its first byte; a slower "
                             "one has its connection closed (jaxllm's flag: vLLM has no bound)")
    parser.add_argument("--request-body-timeout", type=float, default=REQUEST_BODY_TIMEOUT,
                        help="seconds a request body may take to arrive in full after its head; "
                             "a slower one gets 408 and its connection closed (jaxllm's flag: "
                             "vLLM has no bound)")
    parser.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                        metavar="NAME=PATH",
                        help="LoRA adapters served by name (needs --enable-lora): name=path or "
                             'JSON {"name": ..., "path": ..., "base_model_name": ...}')
    parser.add_argument("--metrics-prefix", default="both", choices=sorted(PREFIXES),
                        help="/metrics names: vLLM's (vllm:, what its dashboards query), "
                             "jaxllm:, or both (default)")
    _add_uvicorn_args(parser)
    EngineArgs.add_cli_args(parser)
    add_vllm_compat_flags(parser, SERVER_FLAGS_NO_EFFECT, SERVER_FLAGS_DEFAULT_ONLY,
                          SERVER_FLAGS_NOT_IMPLEMENTED)
    return parser


def _add_uvicorn_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    parser.add_argument("--root-path", default=None,
                        help="the path prefix a proxy serves the API under")
    parser.add_argument("--ssl-keyfile", default=None)
    parser.add_argument("--ssl-certfile", default=None)
    parser.add_argument("--ssl-ca-certs", default=None)
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                        help="whether a client certificate is required (the ssl module's)")


def uvicorn_config(app, args: argparse.Namespace) -> uvicorn.Config:
    return app_uvicorn_config(
        app, args.host, args.port, args.uvicorn_log_level,
        limit_concurrency=args.limit_concurrency, timeout_keep_alive=args.timeout_keep_alive,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        request_header_timeout=args.request_header_timeout,
        request_body_timeout=args.request_body_timeout,
        access_log=not args.disable_uvicorn_access_log, root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


class _OneApiKey(argparse.Action):
    """vLLM's --api-key takes several keys; jaxllm checks one."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if len(values) > 1:
            refuse(parser, "several --api-key values", "one key")
        setattr(namespace, self.dest, values[0])


# vLLM's frontend flags beyond jaxllm's (vllm/entrypoints/openai/cli_args.py); the engine's are
# in jaxllm/engine/args.py, with what each table means.
SERVER_FLAGS_NO_EFFECT = (
    ("--disable-log-requests", False),  # jaxllm does not log requests
    ("--no-disable-log-requests", False),
    ("--enable-log-requests", False),
    ("--no-enable-log-requests", False),
    ("--max-log-len", True),
    ("--disable-frontend-multiprocessing", False),  # one process already
    ("--disable-fastapi-docs", False),  # no docs pages to disable
    ("--enable-prompt-tokens-details", False),  # usage always has them, as OpenAI's
)
SERVER_FLAGS_DEFAULT_ONLY = (
    ("--response-role", "assistant"),
    ("--api-server-count|-asc", "1"),
)
SERVER_FLAGS_NOT_IMPLEMENTED = (
    "--uds", "--disable-access-log-for-endpoints", "--allow-credentials", "--allowed-origins",
    "--allowed-methods", "--allowed-headers", "--ssl-ciphers", "--enable-ssl-refresh",
    "--middleware", "--enable-request-id-headers",
    "--h11-max-header-count", "--enable-offline-docs",
    "--chat-template-content-format", "--trust-request-chat-template",
    "--default-chat-template-kwargs", "--return-tokens-as-token-ids", "--enable-auto-tool-choice",
    "--exclude-tools-when-tool-choice-none", "--tool-call-parser", "--tool-parser-plugin",
    "--tool-server", "--log-config-file",
    "--enable-per-request-metrics", "--enable-server-load-tracking",
    "--enable-force-include-usage", "--enable-log-outputs",
    "--log-error-stack", "--tokens-only", "--headless", "--config", "--fingerprint-mode",
    "--fingerprint-value",
)


def load_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" in value:  # an inline template, as vLLM accepts
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")


def build_serving(args: argparse.Namespace):
    """Loads and warms up the engine, then returns the app's serving state."""
    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.engine.builder import make_engine
    from jaxllm.server.metrics import ServerMetrics
    from jaxllm.server.serving import OpenAIServing

    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"max_queue_len must be at least 1, got {args.max_queue_len}.")
    chat_template = load_chat_template(args.chat_template)
    args.model = args.model_tag or args.model
    engine_args = EngineArgs.from_cli_args(args)
    if args.lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    core = make_engine(engine_args)  # a DPEngine for --data-parallel-size > 1
    adapters = _served_adapters(core, args.lora_modules) if engine_args.enable_lora else None
    engine = AsyncLLM(core, max_queue_len=args.max_queue_len)
    names = args.served_model_name or [core.model_name]  # the first is the one reported
    metrics = ServerMetrics(names[0], core.max_model_len, cache_config_info(core),
                            args.metrics_prefix)
    return OpenAIServing(engine, names, metrics, chat_template, adapters)


def _served_adapters(core, modules) -> ServedAdapters:
    """--lora-modules, loaded now: a bad adapter stops the start-up with its error."""
    adapters = ServedAdapters()
    for module in modules or ():
        lora_request = adapters.new_request(module)
        core.add_lora(lora_request)
        adapters.add(lora_request)
    return adapters


def cache_config_info(core) -> dict:
    """vLLM's cache_config_info labels, as far as jaxllm has them."""
    cache = core.config.cache_config
    return {"block_size": cache.block_size, "cache_dtype": "auto",
            "enable_prefix_caching": cache.enable_prefix_caching,
            "gpu_memory_utilization": cache.gpu_memory_utilization,
            "num_gpu_blocks": core.get_stats()["num_blocks"],
            "num_gpu_blocks_override": cache.num_gpu_blocks_override,
            "kv_cache_memory_bytes": cache.kv_cache_memory_bytes}


def run_serve(args: argparse.Namespace) -> None:
    from jaxllm.server.app import build_app

    serving = build_serving(args)
    app = build_app(serving, api_key=args.api_key,
                    max_request_body_bytes=args.max_request_body_bytes,
                    request_body_timeout=args.request_body_timeout,
                    enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)
    try:
        asyncio.run(_serve(uvicorn.Server(uvicorn_config(app, args)), args,
                           serving.served_model_names[0]))
    finally:
        serving.engine.shutdown()


async def _serve(server: uvicorn.Server, args: argparse.Namespace, model_name: str) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        logger.info("jaxllm API server ready on http://%s:%d (model %s)", args.host, args.port,
                    model_name)
    await task
