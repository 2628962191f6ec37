"""One GPU against N: TP=N, PP=N, DP=N (and TP=2 x PP=N/2 from four GPUs), Llama-3.1-8B shape,
dummy bf16 weights, through `jaxllm bench` (so each line comes with its roofline over the mesh).

Per layout, each in its own process (a clean set of devices):
  latency:    `jaxllm bench latency --batch-size 1 --input-len 128 --output-len 128
               --measure-decode`: the batch-1 decode step (ms/token) beside its floor
  throughput: `jaxllm bench throughput --dataset-name random --num-prompts 1000 --input-len 1000
               --output-len 1000`: output tokens/s beside the workload's floor over all devices
Writes OUT/multi_gpu.json and OUT/multi_gpu.md (a table for the lab log, docs/lab/).

    python benchmarks/multi_gpu.py --out DIR [--num-gpus N] [--only tp1 ppN ...]
        [--skip-throughput | --skip-latency]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PRESET = "llama-3.1-8b"
LATENCY = ["--batch-size", "1", "--input-len", "128", "--output-len", "128", "--num-iters", "5",
           "--num-iters-warmup", "2", "--measure-decode"]
THROUGHPUT = ["--dataset-name", "random", "--num-prompts", "1000", "--input-len", "1000",
              "--output-len", "1000"]
ENGINE = ["--model", PRESET, "--load-format", "dummy", "--dtype", "bfloat16",
          "--max-model-len", "2048", "--disable-tqdm"]
TIMEOUT_S = {"latency": 600, "throughput": 1200}


def layouts(num_gpus: int) -> dict[str, dict[str, int]]:
    """name -> parallel sizes: one GPU, then every way of using all num_gpus."""
    out = {"tp1": {}}
    if num_gpus > 1:
        out |= {f"tp{num_gpus}": {"tensor_parallel_size": num_gpus},
                f"pp{num_gpus}": {"pipeline_parallel_size": num_gpus},
                f"dp{num_gpus}": {"data_parallel_size": num_gpus}}
    if num_gpus >= 4:
        out[f"tp2xpp{num_gpus // 2}"] = {"tensor_parallel_size": 2,
                                         "pipeline_parallel_size": num_gpus // 2}
    return out


def _flags(sizes: dict[str, int]) -> list[str]:
    return [arg for name, size in sizes.items()
            for arg in (f"--{name.replace('_', '-')}", str(size))]


def run_bench(kind: str, sizes: dict[str, int], out_dir: str, name: str,
              workload: list[str] | None = None) -> dict:
    """One `jaxllm bench` run in its own process (workload: its flags, default LATENCY or
    THROUGHPUT); its JSON result, or the error."""
    out_json = os.path.join(out_dir, f"{name}_{kind}.json")
    workload = workload or (LATENCY if kind == "latency" else THROUGHPUT)
    command = [sys.executable, "-m", "jaxllm.cli", "bench", kind, *ENGINE, *_flags(sizes),
               *workload, "--output-json", out_json]
    print("$ " + " ".join(command[2:]), file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S[kind])
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {TIMEOUT_S[kind]} s"}
    lines = [line for line in proc.stdout.splitlines()
             if line.startswith(("Decode step", "Roofline", "Throughput", "Avg latency"))]
    print("\n".join(lines), file=sys.stderr, flush=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr else "failed"}
    with open(out_json) as f:
        result = json.load(f)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def _row(name: str, sizes: dict, latency: dict | None, throughput: dict | None) -> str:
    cells = [name, str(sizes.get("tensor_parallel_size", 1)),
             str(sizes.get("pipeline_parallel_size", 1)), str(sizes.get("data_parallel_size", 1))]
    decode = (latency or {}).get("decode", {})
    cells.append(f"{decode['median_step_ms']:.2f}" if "median_step_ms" in decode
                 else (latency or {}).get("error", "-"))
    floor = decode.get("roofline", {}).get("floor_s")
    cells.append(f"{100 * floor * 1e3 / decode['median_step_ms']:.0f}%" if floor else "-")
    if throughput and "output_tokens_per_second" in throughput:
        cells += [f"{throughput['output_tokens_per_second']:.0f}",
                  f"{100 * throughput.get('fraction_of_floor', 0):.0f}%"]
    else:
        cells += [(throughput or {}).get("error", "-"), "-"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-gpus", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--only", nargs="+", help="layout names (tp1, tpN, ppN, dpN, tp2xppN)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-latency", action="store_true")
    opts = parser.parse_args()
    num_gpus = opts.num_gpus
    if num_gpus is None:  # not through jax: it would take the GPUs' memory from the runs
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        num_gpus = len(smi.stdout.strip().splitlines())
    os.makedirs(opts.out, exist_ok=True)
    results, rows = {}, []
    for name, sizes in layouts(num_gpus).items():
        if opts.only and name not in opts.only:
            continue
        latency = None if opts.skip_latency else run_bench("latency", sizes, opts.out, name)
        throughput = None if opts.skip_throughput else run_bench("throughput", sizes, opts.out,
                                                                  name)
        results[name] = {"sizes": sizes, "latency": latency, "throughput": throughput}
        rows.append(_row(name, sizes, latency, throughput))
    with open(os.path.join(opts.out, "multi_gpu.json"), "w") as f:
        json.dump(results, f, indent=2)
    table = ("| layout | TP | PP | DP | bs-1 decode ms/token | of its floor | output tok/s "
             "(1000 x 1000 in, 1000 out) | of the mesh's floor |\n"
             "| --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")
    with open(os.path.join(opts.out, "multi_gpu.md"), "w") as f:
        f.write(f"{PRESET}, dummy bf16 weights, {num_gpus} GPUs\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
