"""`jaxllm bench latency | throughput | serve`: the subcommands and their flags (vLLM's names)."""

from __future__ import annotations

import argparse

_COMMANDS = {
    "latency": "latency of one fixed batch (mean, percentiles), optionally the decode step",
    "throughput": "offline engine throughput over a random or ShareGPT dataset",
    "serve": "drive a running OpenAI-compatible server with streaming requests",
}


def add_bench_args(subparsers) -> argparse.ArgumentParser:
    """Adds `bench` with its three subcommands to a parser's subparsers."""
    from jaxllm.bench import latency, serve, throughput

    modules = {"latency": latency, "throughput": throughput, "serve": serve}
    bench = subparsers.add_parser("bench", help="benchmark latency, throughput or a server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, module in modules.items():
        sub = kinds.add_parser(name, help=_COMMANDS[name])
        module.add_args(sub)
        sub.set_defaults(handler=module.main)
    return bench
