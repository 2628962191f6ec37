"""`jaxllm serve`: flags (vLLM's names) and the uvicorn runner."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import uvicorn

from jaxllm.engine.args import EngineArgs

logger = logging.getLogger("jaxllm.server")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="a local HF model directory, a .gguf file, or a dummy preset name "
                             "(default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--model", default=None, help="same as MODEL")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("JAXLLM_API_KEY"),
                        help="require `Authorization: Bearer <key>` on /v1 routes "
                             "(default: $JAXLLM_API_KEY)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one "
                             "(default: the tokenizer's)")
    parser.add_argument("--max-queue-len", type=int, default=None,
                        help="answer 503 while this many requests are waiting")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["debug", "info", "warning", "error", "critical"])
    EngineArgs.add_cli_args(parser)
    return parser


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
    core = make_engine(EngineArgs.from_cli_args(args))  # a DPEngine for --data-parallel-size > 1
    engine = AsyncLLM(core, max_queue_len=args.max_queue_len)
    return OpenAIServing(engine, [core.model_name], ServerMetrics(core.model_name),
                         chat_template)


def run_serve(args: argparse.Namespace) -> None:
    from jaxllm.server.app import build_app

    serving = build_serving(args)
    app = build_app(serving, api_key=args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level, timeout_keep_alive=5)
    try:
        asyncio.run(_serve(uvicorn.Server(config), args))
    finally:
        serving.engine.shutdown()


async def _serve(server: uvicorn.Server, args: argparse.Namespace) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        logger.info("jaxllm API server ready on http://%s:%d (model %s)", args.host, args.port,
                    args.served_model_name or args.model or "SmolLM2-135M-Instruct")
    await task
