"""Where TP's batch-1 decode time goes, and which collective settings this XLA/NCCL offers cut it.

Llama-3.1-8B shape, dummy bf16, through `jaxllm bench latency --measure-decode` (eager: only
the shapes used compile; ~1 minute a setting on an H200 pair), each setting in its own process: TP=1, then TP=N under each variant of the
collective settings below (XLA_FLAGS / NCCL environment added to the process's own). Then a
profile (benchmarks/profile_decode.py, batch 1) of TP=N with the baseline settings and with the
fastest variant: GPU time per kernel name, per GPU, against the step's wall time.

    python benchmarks/tp_gpu.py --out DIR [--num-gpus N] [--variants base oneshot ...]

Writes DIR/tp_gpu.json, DIR/best.env (the fastest variant's variables, to `source` before
other runs) and the two profiles under DIR/profile_*.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multi_gpu import run_bench  # noqa: E402

LATENCY = ["--batch-size", "1", "--input-len", "128", "--output-len", "64", "--num-iters", "1",
           "--num-iters-warmup", "1", "--measure-decode", "--enforce-eager"]
COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES"
# name -> (XLA flags added, other environment added)
VARIANTS = {
    "base": ("", {}),
    # XLA's all-reduce kernel over peer memory for small messages (no NCCL launch), as vLLM's
    # custom all-reduce
    "oneshot": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true", {}),
    # all-reduces on the compute stream: no cross-stream events around each one
    "sync": ("--xla_gpu_disable_async_collectives=ALLREDUCE", {}),
    # the whole step, collectives included, in CUDA graphs
    "graphs": (f"--xla_gpu_enable_command_buffer={COMMAND_BUFFER}", {}),
    "oneshot+graphs": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true "
                       f"--xla_gpu_enable_command_buffer={COMMAND_BUFFER}", {}),
    "oneshot+sync": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true "
                     "--xla_gpu_disable_async_collectives=ALLREDUCE", {}),
    "nccl_symmetric": ("--xla_gpu_experimental_enable_nccl_symmetric_buffers=true", {}),
    "nccl_ll": ("", {"NCCL_PROTO": "LL"}),
}


def variant_env(name: str) -> dict[str, str]:
    flags, extra = VARIANTS[name]
    env = dict(extra)
    if flags:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    return env


def in_env(env: dict[str, str], fn, *args):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def profile(out_dir: str, name: str, tp: int, env: dict[str, str]) -> dict:
    trace_dir = os.path.join(out_dir, f"profile_{name}")
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "profile_decode.py"),
               "--out", trace_dir, "--batch", "1", "--context", "1024", "--steps", "10",
               "--tensor-parallel-size", str(tp)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=400,
                          env=dict(os.environ, **env))
    path = os.path.join(trace_dir, "profile.json")
    if proc.returncode or not os.path.exists(path):
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--skip-profile", action="store_true")
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tp = {"tensor_parallel_size": a.num_gpus}
    results = {"tp1": run_bench("latency", {}, a.out, "tp1", LATENCY)}
    for name in a.variants:
        results[name] = in_env(variant_env(name), run_bench, "latency", tp, a.out, name, LATENCY)
        step = results[name].get("decode", {}).get("median_step_ms")
        print(f"TP={a.num_gpus} {name}: {step} ms/step", file=sys.stderr, flush=True)
        with open(os.path.join(a.out, "tp_gpu.json"), "w") as f:
            json.dump(results, f, indent=1)
    timed = {n: r["decode"]["median_step_ms"] for n, r in results.items()
             if n != "tp1" and "decode" in r}
    best = min(timed, key=timed.get) if timed else "base"
    with open(os.path.join(a.out, "best.env"), "w") as f:
        f.writelines(f"export {k}={shlex.quote(v)}\n" for k, v in variant_env(best).items())
    results["best"] = best
    if not a.skip_profile:
        started = time.perf_counter()
        for name in dict.fromkeys(["base", best]):
            results[f"profile_{name}"] = profile(a.out, name, a.num_gpus, variant_env(name))
        results["profile_wall_s"] = round(time.perf_counter() - started, 1)
    with open(os.path.join(a.out, "tp_gpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({"tp1": results["tp1"].get("decode"), **timed, "best": best}, indent=1))


if __name__ == "__main__":
    main()
