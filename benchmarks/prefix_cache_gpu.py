"""One GPU call: what automatic prefix caching buys, and what it costs when nothing hits.

    python benchmarks/prefix_cache_gpu.py --out DIR          # one H200, ~5 minutes
    python benchmarks/prefix_cache_gpu.py --out DIR --cpu    # the same logic, tiny sizes

On Llama-3.1-8B's shape (dummy bf16 weights), one engine:
1. TTFT of a request whose 2,048-token prefix is cached against the same request uncached
   (median of --ttft-reps; target: at least 10x lower).
2. `bench throughput`'s prefix_repetition workload (8 prefixes x 2,048 tokens + 128-token
   suffixes, 128 out, 500 prompts) with caching on against off (target: at least 2.5x output
   throughput).
3. The random 200/180 x 1000 workload with caching on (all misses) against off (within 2%).

Caching is switched on the one engine (every scheduler's KV cache manager, after a reset), which
for these n = 1 workloads is what an engine built with --no-enable-prefix-caching runs: with
caching off a manager hashes nothing. Rows print as they finish; DIR gets results.json and
report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SIZES = {  # GPU, then --cpu
    "gpu": dict(prefix=2048, suffix=16, ttft_reps=5, rep_prefix=2048, rep_suffix=128,
                rep_prefixes=8, rep_out=128, rep_prompts=500, rand_in=200, rand_out=180,
                rand_prompts=1000),
    "cpu": dict(prefix=64, suffix=4, ttft_reps=3, rep_prefix=64, rep_suffix=8, rep_prefixes=2,
                rep_out=4, rep_prompts=8, rand_in=20, rand_out=6, rand_prompts=8),
}


def make_llm(cpu: bool):
    from jaxllm import LLM

    if not cpu:
        return LLM("llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=4096)
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import build_tiny_tokenizer, save_tiny_checkpoint

    path = save_tiny_checkpoint("llama", tempfile.mkdtemp(), build_tiny_tokenizer())
    return LLM(path, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
               num_gpu_blocks_override=256, block_size=16, compilation_cache_dir=None)


def set_caching(llm, on: bool) -> None:
    core = llm.llm_engine
    if not core.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset: requests still hold blocks")
    for scheduler in core.scheduler_ranks:
        scheduler.kv_cache_manager.enable_caching = on


def ttft(llm, sizes: dict, rng) -> dict:
    """Wall time of a one-token request (its TTFT offline): a new prefix each time, so
    "uncached" misses; then "cached", a new suffix behind the prefix just computed."""
    from jaxllm import SamplingParams

    vocab = llm.llm_engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def timed(prompt: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return time.perf_counter() - start, out.num_cached_tokens

    set_caching(llm, True)
    uncached, cached, hits = [], [], []
    for _ in range(sizes["ttft_reps"]):
        prefix = rng.integers(0, vocab, sizes["prefix"]).tolist()
        seconds, num_hit = timed(prefix + rng.integers(0, vocab, sizes["suffix"]).tolist())
        uncached.append(seconds)
        assert num_hit == 0, num_hit
        seconds, num_hit = timed(prefix + rng.integers(0, vocab, sizes["suffix"]).tolist())
        cached.append(seconds)
        hits.append(num_hit)
    row = {"uncached_ms": 1e3 * statistics.median(uncached),
           "cached_ms": 1e3 * statistics.median(cached), "cached_tokens": hits,
           "prefix_len": sizes["prefix"], "suffix_len": sizes["suffix"]}
    row["speedup"] = row["uncached_ms"] / row["cached_ms"]
    return row


def throughput(llm, requests, caching: bool) -> dict:
    from jaxllm.bench.throughput import run_throughput

    set_caching(llm, caching)
    stats = llm.llm_engine.get_stats()
    result = run_throughput(llm, requests, use_tqdm=False)
    after = llm.llm_engine.get_stats()
    result["prefix_cache_hit_tokens"] = (after["prefix_cache_hits_total"]
                                         - stats["prefix_cache_hits_total"])
    return result


def compare(llm, name: str, requests, report) -> dict:
    rows = {}
    for caching in (False, True):
        rows["on" if caching else "off"] = row = throughput(llm, requests, caching)
        report(f"{name} caching {'on ' if caching else 'off'}: "
               f"{row['output_tokens_per_second']:.0f} output tok/s, "
               f"{row['requests_per_second']:.2f} req/s, {row['elapsed_time']:.1f} s, "
               f"{row['prefix_cache_hit_tokens']} prompt tokens from the cache")
    rows["on_over_off"] = (rows["on"]["output_tokens_per_second"]
                           / rows["off"]["output_tokens_per_second"])
    report(f"{name}: on / off output throughput = {rows['on_over_off']:.3f}")
    return rows


def write_report(out_dir: str, results: dict) -> None:
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    t, rep, rand = results.get("ttft"), results.get("prefix_repetition"), results.get("random")
    lines = ["# Prefix caching", "", f"device: {results['device']}", "",
             "| measurement | caching off / uncached | caching on / cached | ratio | target |",
             "| --- | --- | --- | --- | --- |"]
    if t:
        lines.append(f"| TTFT, {t['prefix_len']}-token prefix + {t['suffix_len']} | "
                     f"{t['uncached_ms']:.1f} ms | {t['cached_ms']:.1f} ms | "
                     f"{t['speedup']:.1f}x | >= 10x |")
    for name, rows, target in (("prefix_repetition", rep, ">= 2.5x"),
                               ("random", rand, "0.98 - 1.02")):
        if rows:
            lines.append(f"| {name} output tok/s | {rows['off']['output_tokens_per_second']:.0f}"
                         f" | {rows['on']['output_tokens_per_second']:.0f} | "
                         f"{rows['on_over_off']:.3f} | {target} |")
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="a tiny model and tiny sizes")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["ttft", "prefix_repetition", "random"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import jax
    import numpy as np

    from jaxllm.bench.datasets import prefix_repetition_requests, random_requests

    sizes = SIZES["cpu" if args.cpu else "gpu"]
    start = time.perf_counter()

    def report(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {line}", flush=True)

    llm = make_llm(args.cpu)
    vocab = llm.llm_engine.vocab_size
    results = {"device": str(jax.devices()[0].device_kind), "sizes": sizes}
    report(f"engine ready on {results['device']}")
    if "ttft" not in args.skip:
        results["ttft"] = row = ttft(llm, sizes, np.random.default_rng(0))
        report(f"TTFT uncached {row['uncached_ms']:.1f} ms, cached {row['cached_ms']:.1f} ms "
               f"({row['speedup']:.1f}x, cached tokens {row['cached_tokens']})")
        write_report(args.out, results)
    if "prefix_repetition" not in args.skip:
        requests = prefix_repetition_requests(
            sizes["rep_prompts"], sizes["rep_prefix"], sizes["rep_suffix"],
            sizes["rep_prefixes"], sizes["rep_out"], vocab)
        results["prefix_repetition"] = compare(llm, "prefix_repetition", requests, report)
        write_report(args.out, results)
    if "random" not in args.skip:
        requests = random_requests(sizes["rand_prompts"], sizes["rand_in"], sizes["rand_out"],
                                   vocab)
        results["random"] = compare(llm, "random", requests, report)
        write_report(args.out, results)
    report(f"done; {args.out}/results.json and report.md")


if __name__ == "__main__":
    main()
