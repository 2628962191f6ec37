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
import time
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


def decode_steps(engine, batch: int, context_len: int, num_steps: int,
                 trace_dir: str | None) -> dict:
    """Prefills `batch` random prompts, then times num_steps decode-only engine steps, traced
    when trace_dir is given (the trace itself slows the host)."""
    import contextlib

    import jax
    import numpy as np

    from jaxllm import SamplingParams
    from jaxllm.bench.latency import decode_tokens_needed

    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=decode_tokens_needed(
        engine, batch, context_len, num_steps))
    ids = [f"profile-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(0, engine.vocab_size, context_len).tolist(),
                           params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    engine.step()
    tracing = (jax.profiler.trace(trace_dir, create_perfetto_trace=True) if trace_dir
               else contextlib.nullcontext())
    with tracing:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = time.perf_counter() - start
    assert engine.scheduler.num_running == batch, "a sequence finished inside the timed steps"
    engine.abort_request(ids)
    return {"batch": batch, "wall_ms_per_step": wall * 1e3 / num_steps}


def main() -> None:
    from jaxllm import LLM

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
              num_gpu_blocks_override=None,
              async_scheduling=a.async_scheduling)
    engine = llm.llm_engine
    results = {}
    for batch in a.batch or [1]:
        decode_steps(engine, batch, a.context, 2, None)  # compile
        untraced = decode_steps(engine, batch, a.context, 4 * a.steps, None)
        trace_dir = os.path.join(a.out, f"trace_b{batch}")
        timing = decode_steps(engine, batch, a.context, a.steps, trace_dir)
        timing["untraced_wall_ms_per_step"] = untraced["wall_ms_per_step"]
        timing.update(kernel_summary(trace_dir, a.steps))
        results[f"b{batch}"] = timing
        print(json.dumps(timing, indent=1), flush=True)
    with open(os.path.join(a.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
