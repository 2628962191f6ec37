"""A bounded load run against a real `python -m jaxllm.server` on loopback (CPU, tiny model).

Concurrent clients send greedy completions and chats, streamed or not, n up to 3; a share of
them leave at a random moment. Afterwards the script checks that nothing failed unintendedly,
that the engine is idle with every KV block free, that the server's RSS stayed flat over the
second half, and that every completed request's output equals the same request run alone.

    python benchmarks/load_test.py                      # 10 minutes, 48 clients
    python benchmarks/load_test.py --duration 25 --prompts 8   # about what the tests run

Exit status 0 when every check passes; the figures go to stdout as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from jaxllm.server.testing import RemoteServer  # noqa: E402

SERVER_ARGS = ["--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens",
               "128", "--block-size", "8", "--num-gpu-blocks-override", "192"]
_WORDS = ("fox jumps over the lazy dog paged attention keys values blocks tokens hello world "
          "compiles numerical programs kernels").split()
MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Job:
    chat: bool
    stream: bool
    n: int
    prompt: str

    def body(self) -> dict:
        common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "n": self.n,
                  "stream": self.stream}
        if self.chat:
            return {**common, "messages": [{"role": "user", "content": self.prompt}]}
        return {**common, "prompt": self.prompt}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class Tally:
    completed: dict[Job, list[list[str]]] = field(default_factory=dict)
    cancelled: int = 0
    errors: list[str] = field(default_factory=list)


def random_job(rng: random.Random, prompts: list[str]) -> Job:
    return Job(chat=rng.random() < 0.4, stream=rng.random() < 0.5, n=rng.randint(1, 3),
               prompt=rng.choice(prompts))


async def run_job(http: httpx.AsyncClient, job: Job) -> list[str]:
    """The choices' texts, by index; raises on anything but a clean 200."""
    texts = [""] * job.n
    async with http.stream("POST", job.path, json=job.body()) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:200]!r}")
        if not job.stream:
            for choice in json.loads(await response.aread())["choices"]:
                texts[choice["index"]] = choice.get("text", (choice.get("message") or {})
                                                    .get("content"))
            return texts
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk["choices"]:
                delta = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] += delta
    return texts


async def client(http: httpx.AsyncClient, rng: random.Random, prompts: list[str],
                 deadline: float, cancel_share: float, tally: Tally) -> None:
    while time.monotonic() < deadline:
        job = random_job(rng, prompts)
        leave_after = rng.uniform(0.01, 3.0) if rng.random() < cancel_share else None
        try:
            async with asyncio.timeout(leave_after or REQUEST_TIMEOUT_S):
                texts = await run_job(http, job)
        except TimeoutError:
            if leave_after is None:
                tally.errors.append(f"no answer in {REQUEST_TIMEOUT_S} s: {job}")
            else:
                tally.cancelled += 1
            continue
        except Exception as error:  # noqa: BLE001 - every failure is reported
            tally.errors.append(f"{job.path}: {error!r}"[:300])
            continue
        tally.completed.setdefault(job, []).append(texts)


async def sample_rss(pid: int, deadline: float, samples: list[tuple[float, float]]) -> None:
    start = time.monotonic()
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - start, rss_mib(pid)))
        await asyncio.sleep(1.0)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


async def load(server: RemoteServer, args, prompts: list[str]) -> tuple[Tally, list]:
    tally, samples = Tally(), []
    deadline = time.monotonic() + args.duration
    # A client must drop an idle connection before the server does (uvicorn: 5 s), or a request
    # sent as the server closes it fails: HTTP/1.1's keep-alive race, not the server's fault.
    limits = httpx.Limits(max_connections=args.clients + 8, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S,
                                 limits=limits) as http:
        rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
        await asyncio.gather(sample_rss(server.proc.pid, deadline, samples),
                             *(client(http, rng, prompts, deadline, args.cancel_share, tally)
                               for rng in rngs))
    return tally, samples


async def quiet_run(server: RemoteServer, jobs: list[Job]) -> dict[tuple[bool, str], str]:
    """Each distinct (endpoint, prompt) completed under load once more, alone, n=1: the
    reference for greedy outputs (which depend on neither streaming nor n)."""
    keys = sorted({(job.chat, job.prompt) for job in jobs})
    async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        return {(chat, prompt): (await run_job(http, Job(chat, False, 1, prompt)))[0]
                for chat, prompt in keys}


def wait_idle(server: RemoteServer, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    metrics = server.metrics()
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if (metrics["jaxllm:num_requests_running"] == metrics["jaxllm:num_requests_waiting"] == 0
                and metrics["jaxllm:kv_cache_usage_perc"] == 0):
            break
        time.sleep(0.2)
    return metrics


def rss_growth(samples: list[tuple[float, float]]) -> float:
    """Median RSS of the last quarter over that of the third quarter, less one."""
    values = [rss for _, rss in samples]
    quarter = max(len(values) // 4, 1)
    third, last = values[-2 * quarter:-quarter] or values, values[-quarter:]
    return sorted(last)[len(last) // 2] / sorted(third)[len(third) // 2] - 1


def summarize(tally: Tally, idle: dict, metrics: dict, samples, reference, args) -> dict:
    mismatched = [f"{job}: {got} != {reference[job.chat, job.prompt]!r}"
                  for job, runs in tally.completed.items() for got in runs
                  if got != [reference[job.chat, job.prompt]] * job.n]
    growth = rss_growth(samples)
    return {
        "duration_s": args.duration, "clients": args.clients,
        "completed": sum(len(r) for r in tally.completed.values()),
        "cancelled": tally.cancelled,
        "unintended_errors": tally.errors[:20], "num_unintended_errors": len(tally.errors),
        "greedy_mismatches": mismatched[:5], "num_greedy_mismatches": len(mismatched),
        "final": {name: metrics[f"jaxllm:{name}"] for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "num_free_blocks")},
        "idle_free_blocks": idle["jaxllm:num_free_blocks"],
        "rss_mib": [round(rss) for _, rss in samples[::max(len(samples) // 20, 1)]],
        "rss_growth_second_half": round(growth, 4),
        "ok": not tally.errors and not mismatched and growth <= args.rss_tolerance
        and metrics["jaxllm:num_requests_running"] == 0
        and metrics["jaxllm:num_requests_waiting"] == 0
        and metrics["jaxllm:kv_cache_usage_perc"] == 0
        and metrics["jaxllm:num_free_blocks"] == idle["jaxllm:num_free_blocks"],
    }


def tiny_model(out_dir: str) -> str:
    from conftest import build_tiny_tokenizer, save_tiny_checkpoint
    return save_tiny_checkpoint("llama", out_dir, build_tiny_tokenizer(), seed=1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=48)
    parser.add_argument("--cancel-share", type=float, default=0.3)
    parser.add_argument("--model", default=None, help="default: a tiny random Llama")
    parser.add_argument("--prompts", type=int, default=24, help="distinct prompts in the mix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-tolerance", type=float, default=0.05,
                        help="allowed RSS growth from the third to the last quarter")
    parser.add_argument("--server-args", default="", help="extra flags for the server")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 40)))
               for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="jaxllm-load-") as tmp:
        model = args.model or tiny_model(tmp)
        server = RemoteServer(model, SERVER_ARGS + args.server_args.split())
        try:
            idle = wait_idle(server)
            tally, samples = asyncio.run(load(server, args, prompts))
            metrics = wait_idle(server)
            reference = asyncio.run(quiet_run(server, list(tally.completed)))
        finally:
            server.close()
    summary = summarize(tally, idle, metrics, samples, reference, args)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
