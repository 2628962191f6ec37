"""TP=2 vs TP=1 (Llama-3.1-8B shape) and EP=2 vs TP=2 (Qwen3-30B-A3B shape), dummy weights.

Needs two GPUs. Every configuration runs in its own process (a clean device); each measures
  decode latency: one 128-token prompt, (time of 129 output tokens - time of 1) / 128, and
  offline throughput: NUM_PROMPTS prompts of PROMPT_LEN random tokens, OUTPUT_LEN tokens each
                      (ignore_eos), output tokens / wall time of LLM.generate,
after a warm-up run of the same shapes (the step compiles on first use: enforce_eager=True).
Writes OUT/sharding.json and OUT/sharding.md (a table for docs/benchmarks.md).

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
}
TIMEOUT_S = {"llama-3.1-8b": 160, "qwen3-30b-a3b": 420}  # per config: load + compile + runs
MAX_MODEL_LEN = 1024


def _prompts(n: int, length: int, vocab: int) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(10, vocab - 10, size=length).tolist()}
            for _ in range(n)]


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
    vocab = llm.llm_engine.vocab_size
    if latency:
        one = _prompts(1, 128, vocab)
        _timed_generate(llm, one, 129)  # warm-up: compiles the prefill and decode buckets
        t1, _ = _timed_generate(llm, one, 1)
        t129, _ = _timed_generate(llm, one, 129)
        result["decode_ms_per_token_bs1"] = round((t129 - t1) / 128 * 1e3, 3)
    batch = _prompts(NUM_PROMPTS, PROMPT_LEN, vocab)
    _timed_generate(llm, batch, 8)  # warm-up of the batch's buckets
    elapsed, tokens = _timed_generate(llm, batch, OUTPUT_LEN)
    result.update(throughput_tok_s=round(tokens / elapsed, 1), throughput_wall_s=round(elapsed, 2))
    return result


def _markdown(results: list[dict]) -> str:
    lines = ["| config | TP | EP | startup s | bs-1 decode ms/token | output tok/s "
             f"({NUM_PROMPTS} x {PROMPT_LEN} in, {OUTPUT_LEN} out) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | | | | failed: {r['error'][:80]} | |")
            continue
        lines.append(f"| {r['preset']} | {r.get('tensor_parallel_size', 1)} | "
                     f"{'yes' if r.get('enable_expert_parallel') else 'no'} | {r['startup_s']} | "
                     f"{r.get('decode_ms_per_token_bs1', '-')} | {r['throughput_tok_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", choices=sorted(CONFIGS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(run_one(opts.child)), flush=True)
        return
    os.makedirs(opts.out, exist_ok=True)
    results = []
    for name in [opts.only] if opts.only else CONFIGS:
        print(f"== {name}", flush=True)
        timeout_s = TIMEOUT_S[CONFIGS[name][0]]
        try:
            proc = subprocess.run([sys.executable, __file__, "--out", opts.out, "--child", name],
                                  capture_output=True, text=True, timeout=timeout_s)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if lines:
                result = json.loads(lines[-1][len("RESULT "):])
            else:
                result = {"name": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
                with open(os.path.join(opts.out, f"{name}.stderr.txt"), "w") as f:
                    f.write(proc.stderr)
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
