"""`jaxllm bench latency`: end-to-end latency of one fixed batch (vLLM's output), and with
--measure-decode the steady-state decode step time at the prompt's context beside its floor."""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import numpy as np
from tqdm.auto import tqdm

from jaxllm.bench import roofline, spec_decode
from jaxllm.bench.datasets import random_requests
from jaxllm.bench.throughput import (add_engine_args, engine_prompt, make_llm,
                                     measure_device_ceilings)
from jaxllm.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--measure-decode", action="store_true",
                        help="also time decode-only steps at input-len context (ms/token)")
    parser.add_argument("--output-json", default=None)
    add_engine_args(parser)


def run_latency(llm, batch_size: int, input_len: int, output_len: int, num_iters_warmup: int,
                num_iters: int, seed: int = 0, use_tqdm: bool = True) -> dict:
    """Seconds to generate output_len tokens for a batch of random input_len-token prompts."""
    requests = random_requests(batch_size, input_len, output_len, llm.input_processor.vocab_size,
                               seed=seed)
    prompts = [engine_prompt(r) for r in requests]
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(num_iters_warmup), desc="Warmup iterations", disable=not use_tqdm):
        run_once()
    latencies = np.array([run_once() for _ in tqdm(range(num_iters), desc="Profiling iterations",
                                                   disable=not use_tqdm)])
    return {"avg_latency": float(latencies.mean()), "latencies": latencies.tolist(),
            "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES}}


def format_result(result: dict) -> str:
    lines = [f"Avg latency: {result['avg_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in result["percentiles"].items()]
    return "\n".join(lines)


def _decode_tokens_needed(engine, batch_size: int, context_len: int, num_steps: int) -> int:
    """max_tokens that keeps every sequence decoding through num_steps timed steps: the batch's
    prefill takes up to this many steps, and the first prompts decode all the while."""
    budget = engine.config.scheduler_config.max_num_batched_tokens
    prefill_steps = batch_size + -(-batch_size * context_len // budget)
    return num_steps + prefill_steps + 4


def measure_decode_step(engine, batch_size: int, context_len: int, num_steps: int,
                        seed: int = 0, around_timed_steps=contextlib.nullcontext,
                        lora_request=None) -> dict:
    """Prefills batch_size random prompts of context_len tokens, then times num_steps engine
    steps in which every sequence decodes one token, inside `around_timed_steps()` (e.g. a
    profiler trace). engine: an EngineCore with nothing running; lora_request: the adapter
    every sequence runs with."""
    if engine.has_unfinished_requests():
        raise ValueError("measure_decode_step needs an idle engine.")
    max_tokens = _decode_tokens_needed(engine, batch_size, context_len, num_steps)
    requests = random_requests(batch_size, context_len, max_tokens, engine.vocab_size, seed=seed)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=max_tokens)
    ids = [f"decode-bench-{seed}-{i}" for i in range(batch_size)]
    for request_id, r in zip(ids, requests):
        engine.add_request(request_id, r.prompt, params, lora_request=lora_request)
    started: set[str] = set()
    try:
        while len(started) < batch_size:  # prefill; the last prefill chunk samples token 1
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        engine.step()  # the first step whose every sequence decodes
        times = np.empty(num_steps)
        with around_timed_steps():
            for i in range(num_steps):
                start = time.perf_counter()
                engine.step()
                times[i] = time.perf_counter() - start
        if engine.scheduler.num_running != batch_size:
            raise RuntimeError(f"{engine.scheduler.num_running} of {batch_size} sequences "
                               "still running after the timed steps: the timing is not of "
                               f"batch {batch_size}.")
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return {"batch_size": batch_size, "context_len": context_len, "num_steps": num_steps,
            "mean_step_ms": float(times.mean() * 1e3),
            "median_step_ms": float(np.median(times) * 1e3),
            "p99_step_ms": float(np.percentile(times, 99) * 1e3)}


def main(args: argparse.Namespace) -> dict:
    llm = make_llm(args)
    result = run_latency(llm, args.batch_size, args.input_len, args.output_len,
                         args.num_iters_warmup, args.num_iters, args.seed,
                         use_tqdm=not args.disable_tqdm)
    print(format_result(result), flush=True)
    spec_decode.report(result, llm.llm_engine.get_stats())
    if args.measure_decode:
        decode = measure_decode_step(llm.llm_engine, args.batch_size, args.input_len,
                                     max(args.output_len, 8), args.seed)
        result["decode"] = decode
        line = (f"Decode step: {decode['median_step_ms']:.3f} ms median (mean "
                f"{decode['mean_step_ms']:.3f}) at batch {args.batch_size}, context "
                f"{args.input_len}")
        if not args.no_roofline:
            floor = roofline.mesh_decode_step_floor(
                roofline.model_args_of(args.model, args.load_format), args.batch_size,
                args.input_len, measure_device_ceilings(args), args.tensor_parallel_size,
                args.data_parallel_size, roofline.Storage.of_engine(llm.llm_engine.config))
            decode["roofline"] = floor
            line += "; " + roofline.describe(floor, decode["median_step_ms"] / 1e3)
        print(line, flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
