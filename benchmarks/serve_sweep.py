"""Serving sweep: `jaxllm serve` of a dummy-weight preset, driven by `jaxllm bench serve`'s client
at several Poisson request rates, in one call.

    python benchmarks/serve_sweep.py --out DIR [--rates inf,16,4,1] [--num-prompts 500]

Each rate gets `--num-prompts` random requests, or fewer where the arrivals alone would outlast
`--max-arrival-s` (the prompt count is recorded with each result). Writes sweep.json (vLLM's key
names per rate) and prints vLLM's result block per rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time


def write_plot(results: dict, path: str) -> None:
    """Mean and p99 TTFT and TPOT against the request rate (inf drawn past the last rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((r["request_rate"], r) for k, r in results.items() if k.startswith("rate_"))
    finite = [rate for rate, _ in runs if rate != float("inf")]
    x = [rate if rate != float("inf") else 4 * max(finite, default=1) for rate, _ in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for stat in ("mean", "p99"):
            ax.plot(x, [r[f"{stat}_{metric}_ms"] for _, r in runs], marker="o", label=stat)
        ax.set(xscale="log", yscale="log", xlabel="request rate (req/s; rightmost: inf)",
               ylabel=f"{metric.upper()} (ms)", title=metric.upper())
        ax.set_xticks(x, [f"{rate:g}" for rate, _ in runs])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"jaxllm serve {results.get('model', '')}: {results.get('input_len', '')} in / "
                 f"{results.get('output_len', '')} out")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    from jaxllm.bench.datasets import random_requests
    from jaxllm.bench.serve import benchmark, format_result
    from jaxllm.models.presets import PRESETS
    from jaxllm.server.testing import RemoteServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--rates", default="inf,16,4,1")
    parser.add_argument("--num-prompts", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-arrival-s", type=float, default=60.0)
    parser.add_argument("--plot-only", action="store_true", help="redraw OUT/sweep.png")
    parser.add_argument("--server-args", default="--load-format dummy --dtype bfloat16 "
                        "--max-model-len 4096 --max-num-seqs 256")
    a = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.makedirs(a.out, exist_ok=True)
    if a.plot_only:
        with open(os.path.join(a.out, "sweep.json")) as f:
            write_plot(json.load(f), os.path.join(a.out, "sweep.png"))
        return
    os.environ.setdefault("JAX_PLATFORMS", "")  # RemoteServer defaults its child to the CPU
    start = time.perf_counter()
    server = RemoteServer(a.model, a.server_args.split(), startup_timeout=240)
    results = {"server_ready_s": time.perf_counter() - start, "server_args": a.server_args,
               "model": a.model, "input_len": a.input_len, "output_len": a.output_len}
    print(f"server ready in {results['server_ready_s']:.1f}s", flush=True)
    vocab_size = (PRESETS[a.model]["vocab_size"] if a.model in PRESETS else
                  json.load(open(os.path.join(a.model, "config.json")))["vocab_size"])
    try:
        for rate in (float(r) for r in a.rates.split(",")):
            count = a.num_prompts if rate == float("inf") else min(
                a.num_prompts, max(int(rate * a.max_arrival_s), 1))
            requests = random_requests(count, a.input_len, a.output_len, vocab_size, seed=0)
            result = asyncio.run(benchmark(server.url, "/v1/completions", a.model, requests,
                                           request_rate=rate, ignore_eos=True, use_tqdm=False))
            print(format_result(result), flush=True)
            # the summary figures only: per-request lists (ttfts, itls, ...) run to megabytes
            results[f"rate_{rate:g}"] = {k: v for k, v in result.items()
                                         if not isinstance(v, list)}
            with open(os.path.join(a.out, "sweep.json"), "w") as f:
                json.dump(results, f, indent=1)
        write_plot(results, os.path.join(a.out, "sweep.png"))
    finally:
        with open(os.path.join(a.out, "server.log"), "w") as f:
            f.write(server.log_tail(200_000))
        server.close()


if __name__ == "__main__":
    main()
