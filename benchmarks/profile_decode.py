"""Where a decode step's time goes on the GPU: a jax.profiler trace of engine steps, summed per
GPU kernel, against the wall time of the same steps.

    python benchmarks/profile_decode.py --out DIR [--batch 1 --batch 64]

Reads the Perfetto JSON that jax.profiler writes, so no profiler UI is needed.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
from collections import defaultdict


def kernel_summary(trace_dir: str, num_steps: int, top: int = 25) -> dict:
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
                  + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                              recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    per_process = defaultdict(lambda: defaultdict(float))  # process -> event name -> us
    for e in events:
        if e.get("ph") == "X":
            per_process[process.get(e["pid"], str(e["pid"]))][e["name"][:90]] += e.get("dur", 0)
    return {"trace": path, **{
        f"top_us_per_step {name}": [(k, round(v / num_steps, 1)) for k, v in
                                    sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]
        for name, by_name in per_process.items()}}


def main() -> None:
    import jax

    from jaxllm import LLM
    from jaxllm.bench.latency import measure_decode_step

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    a = parser.parse_args()
    dummy = not os.path.isdir(a.model)
    llm = LLM(a.model, load_format="dummy" if dummy else "auto",
              dtype="bfloat16" if dummy else "auto", max_model_len=4096 if dummy else 512,
              max_num_seqs=256, max_num_batched_tokens=2048, enforce_eager=True,
              async_scheduling=a.async_scheduling)
    engine = llm.llm_engine
    results = {}
    for batch in a.batch or [1]:
        measure_decode_step(engine, batch, a.context, 2)  # compile
        untraced = measure_decode_step(engine, batch, a.context, 4 * a.steps)
        trace_dir = os.path.join(a.out, f"trace_b{batch}")
        traced = measure_decode_step(engine, batch, a.context, a.steps, around_timed_steps=(
            lambda d=trace_dir: jax.profiler.trace(d, create_perfetto_trace=True)))
        timing = {"batch": batch, "wall_ms_per_step": traced["mean_step_ms"],
                  "untraced_wall_ms_per_step": untraced["mean_step_ms"],
                  **kernel_summary(trace_dir, a.steps)}
        results[f"b{batch}"] = timing
        print(json.dumps(timing, indent=1), flush=True)
    with open(os.path.join(a.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
