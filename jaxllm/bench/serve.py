"""`jaxllm bench serve`: drives a running OpenAI-compatible server over HTTP with streaming.

Requests arrive as a Poisson process at --request-rate (gamma with --burstiness; inf sends all
at once), at most --max-concurrency in flight. TTFT, TPOT (excluding the first token), ITL and
end-to-end latency are measured per request; the result block and the JSON use vLLM's names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx
import numpy as np
from tqdm.auto import tqdm

from jaxllm.bench.datasets import (ConversationHistory, SampleRequest, add_dataset_args,
                                   conversations, sample_requests)

_TIMEOUT = httpx.Timeout(6 * 3600.0, connect=60.0)


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None  # from the usage chunk when the server sends it
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    token_ids: list[int] = field(default_factory=list)  # only when asked (multi-turn)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="default http://{host}:{port}")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--tokenizer", default=None,
                        help="HF tokenizer directory (ShareGPT prompts, random vocab size)")
    add_dataset_args(parser, input_len=1024, output_len=128, num_prompts=1000)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the inter-arrival times; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    parser.add_argument("--metric-percentiles", default="99")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None)
    parser.add_argument("--disable-tqdm", action="store_true")


# -- one request --------------------------------------------------------------------------------
async def send_request(client: httpx.AsyncClient, url: str, model: str, request: SampleRequest,
                       ignore_eos: bool, headers: dict,
                       return_token_ids: bool = False) -> RequestResult:
    payload = {"model": model, "prompt": request.prompt, "max_tokens":
               request.expected_output_len, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if return_token_ids:  # vLLM's extension: the next turn resends them
        payload["return_token_ids"] = True
    result = RequestResult(request.prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:500]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.generated_text += data["choices"][0].get("text") or ""
                    result.token_ids += data["choices"][0].get("token_ids") or []
                if data.get("usage"):
                    result.output_tokens = data["usage"].get("completion_tokens")
        result.latency = last - start
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "Never received a valid chunk to calculate TTFT."
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


# -- the run --------------------------------------------------------------------------------------
async def arrivals(requests: list[SampleRequest], request_rate: float, burstiness: float,
                   seed: int):
    """Yields the requests with gamma(burstiness, 1 / (rate * burstiness)) gaps."""
    rng = np.random.default_rng(seed)
    for request in requests:
        yield request
        if request_rate != float("inf"):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (request_rate * burstiness)))


async def benchmark(base_url: str, endpoint: str, model: str, requests: list[SampleRequest],
                    request_rate: float = float("inf"), burstiness: float = 1.0,
                    max_concurrency: int | None = None, ignore_eos: bool = False, seed: int = 0,
                    tokenizer=None, percentiles=(99,), use_tqdm: bool = True,
                    headers: dict | None = None) -> dict:
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be positive, got {request_rate} "
                         f"and {burstiness}.")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}.")
    url, headers = base_url.rstrip("/") + endpoint, headers or {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=_TIMEOUT, limits=limits) as client:
        test = await send_request(client, url, model, SampleRequest(
            requests[0].prompt, requests[0].prompt_len, min(requests[0].expected_output_len, 8)),
            ignore_eos, headers)
        if not test.success:
            raise ValueError(f"Initial test run failed - {test.error}")
        sender = _Sender(client, url, model, ignore_eos, headers, max_concurrency,
                         requests[0].conversation is not None,
                         tqdm(total=len(requests), disable=not use_tqdm))
        start = time.perf_counter()
        results = await sender.send_all(requests, request_rate, burstiness, seed)
        duration = time.perf_counter() - start
        sender.bar.close()
    metrics = calculate_metrics(results, duration, tokenizer, percentiles)
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai",
            "model_id": model, "num_prompts": len(requests), "request_rate": request_rate,
            "burstiness": burstiness, "max_concurrency": max_concurrency, **metrics}


@dataclass
class _Sender:
    """Sends the benchmark's requests at their arrival times, at most max_concurrency at once."""
    client: httpx.AsyncClient
    url: str
    model: str
    ignore_eos: bool
    headers: dict
    max_concurrency: int | None
    multi_turn: bool
    bar: tqdm

    def __post_init__(self) -> None:
        self.semaphore = asyncio.Semaphore(self.max_concurrency) if self.max_concurrency else None

    async def send_all(self, requests: list[SampleRequest], request_rate: float,
                       burstiness: float, seed: int) -> list[RequestResult]:
        if self.multi_turn:  # conversations arrive at the request rate
            tasks = [asyncio.create_task(self.converse(turns)) async for turns in arrivals(
                conversations(requests), request_rate, burstiness, seed)]
            return [r for turns in await asyncio.gather(*tasks) for r in turns]
        tasks = [asyncio.create_task(self.send(r))
                 async for r in arrivals(requests, request_rate, burstiness, seed)]
        return list(await asyncio.gather(*tasks))

    async def send(self, request: SampleRequest) -> RequestResult:
        if self.semaphore is None:
            result = await self._send(request)
        else:
            async with self.semaphore:
                result = await self._send(request)
        self.bar.update(1)
        return result

    def _send(self, request: SampleRequest):
        return send_request(self.client, self.url, self.model, request, self.ignore_eos,
                            self.headers, self.multi_turn)

    async def converse(self, turns: list[SampleRequest]) -> list[RequestResult]:
        """A conversation's turns one after the other, each resending it so far."""
        history, results = ConversationHistory(), []
        for turn in turns:
            prompt = history.prompt(turn)
            results.append(await self.send(SampleRequest(prompt, len(prompt),
                                                         turn.expected_output_len)))
            history.record(turn, prompt, results[-1].token_ids)
        return results


def _output_len(result: RequestResult, tokenizer) -> int:
    if result.output_tokens is not None:
        return result.output_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(result.generated_text, add_special_tokens=False))
    return len(result.itl) + 1  # one token per streamed chunk


def calculate_metrics(results: list[RequestResult], duration: float, tokenizer=None,
                      percentiles=(99,)) -> dict:
    done = [r for r in results if r.success]
    output_lens = [_output_len(r, tokenizer) if r.success else 0 for r in results]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(output_lens)
    series = {"ttft": [r.ttft for r in done],
              "tpot": [(r.latency - r.ttft) / (n - 1)
                       for r, n in zip(results, output_lens) if r.success and n > 1],
              "itl": [t for r in done for t in r.itl],
              "e2el": [r.latency for r in done]}
    metrics = {"duration": duration, "completed": len(done), "failed": len(results) - len(done),
               "total_input_tokens": total_input, "total_output_tokens": total_output,
               "request_throughput": len(done) / duration,
               "output_throughput": total_output / duration,
               "total_token_throughput": (total_input + total_output) / duration,
               "input_lens": [r.prompt_len for r in results], "output_lens": output_lens,
               "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
               "generated_texts": [r.generated_text for r in results],
               "errors": [r.error for r in results]}
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1e3
        metrics.update({f"mean_{name}_ms": float(ms.mean()),
                        f"median_{name}_ms": float(np.median(ms)),
                        f"std_{name}_ms": float(ms.std())})
        metrics.update({f"p{_word(p)}_{name}_ms": float(np.percentile(ms, p))
                        for p in percentiles})
    return metrics


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
             ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"),
             ("e2el", "E2EL", "End-to-end Latency"))


def format_result(result: dict, selected=("ttft", "tpot", "itl"), percentiles=(99,)) -> str:
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", result["completed"]),
             row("Failed requests:", result["failed"])]
    if result["max_concurrency"] is not None:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"]))
    if result["request_rate"] != float("inf"):
        lines.append(rowf("Request rate configured (RPS):", result["request_rate"]))
    lines += [rowf("Benchmark duration (s):", result["duration"]),
              row("Total input tokens:", result["total_input_tokens"]),
              row("Total generated tokens:", result["total_output_tokens"]),
              rowf("Request throughput (req/s):", result["request_throughput"]),
              rowf("Output token throughput (tok/s):", result["output_throughput"]),
              rowf("Total Token throughput (tok/s):", result["total_token_throughput"])]
    for key, name, header in _SECTIONS:
        if key not in selected:
            continue
        lines += ["{s:{c}^{n}}".format(s=header, n=50, c="-"),
                  rowf(f"Mean {name} (ms):", result[f"mean_{key}_ms"]),
                  rowf(f"Median {name} (ms):", result[f"median_{key}_ms"])]
        lines += [rowf(f"P{_word(p)} {name} (ms):", result[f"p{_word(p)}_{key}_ms"])
                  for p in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------
def _first_model(base_url: str, headers: dict) -> str:
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _vocab_size(tokenizer, model: str) -> int:
    from jaxllm.models.presets import PRESETS

    if tokenizer is not None:
        return len(tokenizer)
    if model in PRESETS:
        return PRESETS[model]["vocab_size"]
    raise ValueError("The random dataset needs the vocabulary size: pass --tokenizer (an HF "
                     "tokenizer directory) unless the model is a dummy preset.")


def main(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_key = os.environ.get("OPENAI_API_KEY") or os.environ.get("JAXLLM_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = args.model or _first_model(base_url, headers)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    requests = sample_requests(args, tokenizer, _vocab_size(tokenizer, model))
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    result = asyncio.run(benchmark(
        base_url, args.endpoint, model, requests, args.request_rate, args.burstiness,
        args.max_concurrency, args.ignore_eos, args.seed, tokenizer, percentiles,
        use_tqdm=not args.disable_tqdm, headers=headers))
    print(format_result(result, args.percentile_metrics.split(","), percentiles), flush=True)
    if args.save_result:
        name = args.result_filename or (f"openai-{args.request_rate}qps-"
                                        f"{os.path.basename(model)}-{result['date']}.json")
        with open(os.path.join(args.result_dir, name), "w") as f:
            json.dump(result, f)
    return result
