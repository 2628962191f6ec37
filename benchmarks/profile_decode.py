"""Where a step's time goes on the GPU: a jax.profiler trace of engine steps, summed per GPU
kernel (the top ones by name, and every kernel by kind: `kind_us_per_step`, whose total is
`kernel_us_per_step`), and the time in which any kernel ran (`busy_us_per_step`), against the
wall time of the same steps. XLA runs a traced program thunk by thunk unless it is told to keep
its CUDA graphs (`--xla_enable_command_buffers_during_profiling`, set here), so the traced steps
launch as the untraced ones do. With programmatic dependent launch (XLA's default on Hopper) a
kernel's interval starts at its launch, in its wait for the kernel before it, so the busy time
counts those waits too: it bounds the idle time from below. Decode steps at a fixed batch
(--batch), or windows of an offline throughput run (--workload IN,OUT,PROMPTS --window START
...: trace --steps steps from step START on; early windows hold the chunked prefills, late ones
decode).

    python benchmarks/profile_decode.py --out DIR [--batch 1 --batch 64]
    python benchmarks/profile_decode.py --out DIR --workload 200,180,1000 --window 20 --window 400

Reads the Perfetto JSON that jax.profiler writes, so no profiler UI is needed.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
from collections import defaultdict

KEEP_GRAPHS = "--xla_enable_command_buffers_during_profiling=true"


def read_trace(trace_dir: str, pattern: str = "*.trace.json.gz") -> tuple[str, list, dict]:
    """The newest trace under trace_dir (`pattern`, or jax's Perfetto file): (its path, its
    events, pid -> process name)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", pattern), recursive=True)
                  + glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                              recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    return path, events, process


def gpu_stream_events(events: list, process: dict):
    """A test of a trace event: whether it ran on a GPU's stream (a kernel or a copy), not on
    the GPU's other lines (XLA's modules and ops, which span kernels)."""
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return lambda e: (process.get(e["pid"], "").startswith("/device:GPU")
                      and thread.get((e["pid"], e.get("tid")), "").startswith("Stream"))


def annotated_gpu_events(trace_dir: str, prefix: str) -> dict[str, tuple[float, list]]:
    """Each host annotation named prefix + NAME in jax's Perfetto trace -> (its duration in us,
    the GPU stream events (kernels, copies) whose midpoint falls inside it, as (name, us))."""
    _, events, process = read_trace(trace_dir, "perfetto_trace.json.gz")
    on_stream = gpu_stream_events(events, process)
    windows, gpu = {}, []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e["name"].startswith(prefix):
            windows[e["name"][len(prefix):]] = (e["ts"], e["ts"] + e["dur"])
        elif on_stream(e):
            gpu.append((e["ts"] + e["dur"] / 2, e["name"], e["dur"]))
    return {name: (end - start, [(kernel, dur) for mid, kernel, dur in gpu if start <= mid <= end])
            for name, (start, end) in windows.items()}


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: time in which at least one ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def kernel_kind(name: str) -> str:
    """A kernel's name without the numbers XLA appends to tell copies apart (one per layer):
    fp8_gemv__12 and loop_add_fusion_63 are fp8_gemv and loop_add_fusion."""
    return re.sub(r"(_+\d+)+$", "", name)


def kernel_summary(trace_dir: str, num_steps: int, top: int = 25) -> dict:
    """Per process of the trace, per step: the events' summed us by name (the top ones) and
    their count; per GPU, its streams' events summed by kind (all of them) and in total, and the
    us in which any of them ran, so that the step's wall less that is the time the GPU sat idle
    (launch gaps, waits for the host)."""
    path, events, process = read_trace(trace_dir)
    per_process = defaultdict(lambda: defaultdict(float))  # process -> event name -> us
    events_of = defaultdict(int)  # process -> events
    spans = defaultdict(list)  # GPU process -> its streams' events' (start, end)
    kinds = defaultdict(lambda: defaultdict(float))  # GPU process -> kernel kind -> us
    on_stream = gpu_stream_events(events, process)
    for e in events:
        if e.get("ph") == "X":
            name = process.get(e["pid"], str(e["pid"]))
            per_process[name][e["name"][:90]] += e.get("dur", 0)
            events_of[name] += 1
            if on_stream(e):
                spans[name].append((e["ts"], e["ts"] + e.get("dur", 0)))
                kinds[name][kernel_kind(e["name"][:90])] += e.get("dur", 0)
    return {"trace": path, **{
        f"kind_us_per_step {name}": [(k, round(v / num_steps, 1)) for k, v in
                                     sorted(by_kind.items(), key=lambda kv: -kv[1])]
        for name, by_kind in kinds.items()}, **{
        f"kernel_us_per_step {name}": round(sum(by_kind.values()) / num_steps, 1)
        for name, by_kind in kinds.items()}, **{
        f"top_us_per_step {name}": [(k, round(v / num_steps, 1)) for k, v in
                                    sorted(by_name.items(), key=lambda kv: -kv[1])[:top]]
        for name, by_name in per_process.items()}, **{
        f"events_per_step {name}": round(n / num_steps, 1) for name, n in events_of.items()}, **{
        f"busy_us_per_step {name}": round(busy_us(s) / num_steps, 1)
        for name, s in spans.items()}}


def profile_workload(engine, workload: str, windows: list[int], num_steps: int, out: str,
                     loras=()) -> dict:
    """Runs the workload through the engine's step loop, tracing num_steps steps at each window
    start; returns per window the wall ms per step, the running sequences and the kernel sums.
    loras: LoRA requests the prompts take in turn (none: the base model)."""
    import time

    import jax

    from jaxllm.bench.datasets import random_requests
    from jaxllm.sampling_params import SamplingParams

    input_len, output_len, num_prompts = (int(x) for x in workload.split(","))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    requests = random_requests(num_prompts, input_len, output_len, engine.vocab_size, seed=0)
    ids = [f"profile-{i}" for i in range(num_prompts)]
    for i, (request_id, r) in enumerate(zip(ids, requests)):
        engine.add_request(request_id, r.prompt, params,
                           lora_request=loras[i % len(loras)] if loras else None)
    results, step = {}, 0
    try:
        for start in sorted(windows):
            while step < start and engine.has_unfinished_requests():
                engine.step()
                step += 1
            trace_dir = os.path.join(out, f"trace_step{start}")
            running, begin = engine.scheduler.num_running, time.perf_counter()
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(num_steps):
                    engine.step()
                step += num_steps
            results[f"step{start}"] = {
                "wall_ms_per_step": (time.perf_counter() - begin) * 1e3 / num_steps,
                "running_before": running, "running_after": engine.scheduler.num_running,
                **kernel_summary(trace_dir, num_steps)}
            print(json.dumps(results[f"step{start}"], indent=1), flush=True)
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return results


def _random_adapters(model: str, rank: int, count: int, out: str) -> list:
    """Random PEFT adapters on all seven projections, in folders beside the results."""
    from jaxllm import LoRARequest
    from jaxllm.bench import roofline
    from lora_gpu import save_dummy_adapter

    args = roofline.model_args_of(model, "dummy" if not os.path.isdir(model) else "auto")
    return [LoRARequest(f"profiled{i}", i + 1, save_dummy_adapter(
        os.path.join(out, f"adapter{i}"), args, rank, i)) for i in range(count)]


def main() -> None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {KEEP_GRAPHS}".strip()
    import jax

    from jaxllm import LLM
    from jaxllm.bench.latency import measure_decode_step

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25, help="kernels listed per step")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--workload", help="IN,OUT,PROMPTS of an offline run to profile")
    parser.add_argument("--window", type=int, action="append", help="first step of a window")
    parser.add_argument("--pallas-kv-write", action="store_true",
                        help="the engine writes K/V with the Pallas kernel, not the scatter")
    parser.add_argument("--quantization", help="fp8 or an int4 checkpoint's method")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--num-gpu-blocks-override", type=int,
                        help="KV blocks, not sized from free memory")
    parser.add_argument("--random-int4", action="store_true",
                        help="every projection replaced by random packed int4 (group 128)")
    parser.add_argument("--lora-rank", type=int,
                        help="LoRA on, every sequence on a random adapter of this rank")
    parser.add_argument("--num-adapters", type=int, default=1,
                        help="with --lora-rank: a workload's prompts spread over this many "
                             "adapters (max_loras)")
    parser.add_argument("--unstacked", action="store_true",
                        help="the layers' small arrays one buffer a layer (no layer_stacks): "
                             "what the stacks save in dispatch")
    a = parser.parse_args()
    if a.unstacked:
        from jaxllm.engine import model_setup
        model_setup.stack_layers = lambda params: params
    if a.pallas_kv_write:
        from pallas_kernels import kv_write  # the A/B: the engine takes write_kv when built
        kv_write.write_kv = kv_write.write_kv_pallas
    dummy = not os.path.isdir(a.model)
    llm = LLM(a.model, load_format="dummy" if dummy else "auto",
              dtype="bfloat16" if dummy else "auto", max_model_len=4096 if dummy else 512,
              max_num_seqs=a.max_num_seqs, max_num_batched_tokens=max(2048, a.max_num_seqs),
              enforce_eager=not a.workload,  # a workload's windows must not compile buckets
              async_scheduling=a.async_scheduling, tensor_parallel_size=a.tensor_parallel_size,
              quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype,
              num_gpu_blocks_override=a.num_gpu_blocks_override,
              **(dict(enable_lora=True, max_lora_rank=a.lora_rank, max_loras=a.num_adapters)
                 if a.lora_rank else {}))
    engine = llm.llm_engine
    if a.random_int4:
        from quant_gpu import use_random_int4
        use_random_int4(engine)
    loras = _random_adapters(a.model, a.lora_rank, a.num_adapters, a.out) if a.lora_rank else []
    lora = loras[0] if loras else None
    results = {}
    if a.workload:
        results = profile_workload(engine, a.workload, a.window or [20], a.steps, a.out, loras)
    for batch in a.batch or ([] if a.workload else [1]):
        measure_decode_step(engine, batch, a.context, 2, lora_request=lora)  # compile
        untraced = measure_decode_step(engine, batch, a.context, 4 * a.steps, lora_request=lora)
        trace_dir = os.path.join(a.out, f"trace_b{batch}")
        traced = measure_decode_step(engine, batch, a.context, a.steps, around_timed_steps=(
            lambda d=trace_dir: jax.profiler.trace(d, create_perfetto_trace=True)),
            lora_request=lora)
        timing = {"batch": batch, "param_buffers": len(jax.tree.leaves(engine.runner.params)),
                  "wall_ms_per_step": traced["mean_step_ms"],
                  "untraced_wall_ms_per_step": untraced["mean_step_ms"],
                  **kernel_summary(trace_dir, a.steps, a.top)}
        results[f"b{batch}"] = timing
        print(json.dumps(timing, indent=1), flush=True)
    with open(os.path.join(a.out, "profile.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
