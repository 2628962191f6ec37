"""TP=2 vs TP=1 (Llama-3.1-8B shape) and EP=2 vs TP=2 (Qwen3-30B-A3B shape), dummy weights.

The EP runs are vLLM's two layouts of two GPUs: TP=2 with experts split whole over both
(attention still tensor-parallel), and DP=2 with expert parallelism (DP attention: each GPU runs
attention for its own requests, experts split over both).

Needs two GPUs. Every configuration runs in its own process (a clean device); each measures
  decode latency: one 128-token prompt, (time of 129 output tokens - time of 1) / 128, and
  offline throughput: NUM_PROMPTS prompts of PROMPT_LEN random tokens, OUTPUT_LEN tokens each
                      (ignore_eos), output tokens / wall time of LLM.generate,
after a warm-up run of the same shapes (the step compiles on first use: enforce_eager=True).
Writes OUT/sharding.json and OUT/sharding.md (a table for the lab log, docs/lab/).

    python benchmarks/sharding_gpu.py --out DIR [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

NUM_PROMPTS, PROMPT_LEN, OUTPUT_LEN = 64, 128, 64
CONFIGS = {  # name -> (preset, engine kwargs, measure latency?)
    "llama8b_tp1": ("llama-3.1-8b", dict(tensor_parallel_size=1), True),
    "llama8b_tp2": ("llama-3.1-8b", dict(tensor_parallel_size=2), True),
    "qwen3moe_tp2": ("qwen3-30b-a3b", dict(tensor_parallel_size=2), False),
    "qwen3moe_ep2": ("qwen3-30b-a3b", dict(tensor_parallel_size=2, enable_expert_parallel=True),
                     False),
    "qwen3moe_dp2_ep2": ("qwen3-30b-a3b", dict(data_parallel_size=2, enable_expert_parallel=True),
                         False),
}
TIMEOUT_S = {"llama-3.1-8b": 160, "qwen3-30b-a3b": 420}  # per config: load + compile + runs
MAX_MODEL_LEN = 1024


def _prompts(n: int, length: int, vocab: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(10, vocab - 10, size=length).tolist()}
            for _ in range(n)]


def _progress(message: str, start: float) -> None:
    """To stderr, which the parent keeps (also on a timeout): where the time went."""
    print(f"[{time.perf_counter() - start:7.1f} s] {message}", file=sys.stderr, flush=True)


def _timed_generate(llm, prompts, max_tokens: int) -> tuple[float, int]:
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def run_one(name: str) -> dict:
    """In the child process: load, warm up, measure."""
    from jaxllm import LLM

    preset, kwargs, latency = CONFIGS[name]
    start = time.perf_counter()
    llm = LLM(preset, load_format="dummy", max_model_len=MAX_MODEL_LEN, max_num_seqs=NUM_PROMPTS,
              max_num_batched_tokens=2048, gpu_memory_utilization=0.85, enforce_eager=True,
              **kwargs)
    result = {"name": name, "preset": preset, **kwargs,
              "startup_s": round(time.perf_counter() - start, 1)}
    _progress("engine ready", start)
    vocab = llm.llm_engine.vocab_size
    if latency:
        one = _prompts(1, 128, vocab)
        _timed_generate(llm, one, 129)  # warm-up: compiles the prefill and decode buckets
        _progress("batch-1 warm-up done", start)
        t1, _ = _timed_generate(llm, one, 1)
        t129, _ = _timed_generate(llm, one, 129)
        result["decode_ms_per_token_bs1"] = round((t129 - t1) / 128 * 1e3, 3)
        _progress(f"batch-1 decode {result['decode_ms_per_token_bs1']} ms/token", start)
    batch = _prompts(NUM_PROMPTS, PROMPT_LEN, vocab)
    _timed_generate(llm, batch, 8)  # warm-up of the batch's buckets
    _progress("batch warm-up done", start)
    elapsed, tokens = _timed_generate(llm, batch, OUTPUT_LEN)
    result.update(throughput_tok_s=round(tokens / elapsed, 1), throughput_wall_s=round(elapsed, 2))
    return result


def _markdown(results: list[dict]) -> str:
    lines = ["| config | TP | DP | EP | startup s | bs-1 decode ms/token | output tok/s "
             f"({NUM_PROMPTS} x {PROMPT_LEN} in, {OUTPUT_LEN} out) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | | | | | failed: {r['error'][:80]} | |")
            continue
        lines.append(f"| {r['preset']} | {r.get('tensor_parallel_size', 1)} | "
                     f"{r.get('data_parallel_size', 1)} | "
                     f"{'yes' if r.get('enable_expert_parallel') else 'no'} | {r['startup_s']} | "
                     f"{r.get('decode_ms_per_token_bs1', '-')} | {r['throughput_tok_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="+", choices=sorted(CONFIGS))
    parser.add_argument("--timeout-s", type=int, help="per configuration (default: by preset)")
    parser.add_argument("--deadline-s", type=float, default=float("inf"),
                        help="for all configurations: each gets at most what is left")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(run_one(opts.child)), flush=True)
        return
    os.makedirs(opts.out, exist_ok=True)
    results, start = [], time.perf_counter()
    for name in opts.only or CONFIGS:
        print(f"== {name}", flush=True)
        left_s = opts.deadline_s - (time.perf_counter() - start)
        timeout_s = int(min(opts.timeout_s or TIMEOUT_S[CONFIGS[name][0]], left_s))
        if timeout_s < 30:
            results.append({"name": name, "error": "not run: deadline reached"})
            continue
        stderr_path = os.path.join(opts.out, f"{name}.stderr.txt")
        with open(stderr_path, "w") as stderr:
            try:
                proc = subprocess.run([sys.executable, __file__, "--out", opts.out, "--child", name],
                                      stdout=subprocess.PIPE, stderr=stderr, text=True,
                                      timeout=timeout_s)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                result = (json.loads(lines[-1][len("RESULT "):]) if lines else
                          {"name": name, "error": f"exit code {proc.returncode}, see {stderr_path}"})
            except subprocess.TimeoutExpired:
                result = {"name": name, "error": f"timed out after {timeout_s}s"}
        print(result, flush=True)
        results.append(result)
    with open(os.path.join(opts.out, "sharding.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(opts.out, "sharding.md"), "w") as f:
        f.write(_markdown(results))
    print(_markdown(results))


if __name__ == "__main__":
    main()
