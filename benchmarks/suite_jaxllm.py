"""The suite's jaxllm worker: ceilings, engine start-up, decode step at 2k context vs its floor,
offline throughput vs its floor, output throughput against concurrency. Run by gpu_suite.py."""

from __future__ import annotations

import atexit
import gc
import json
import os
import shutil
import tempfile
import time

from suite_plan import Recorder, plan, worker_args, workload_name


def make_llm(p: dict, model: str, compilation_cache_dir: str):
    from jaxllm.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype=p["dtype"], max_model_len=p["max_model_len"],
              max_num_seqs=p["max_num_seqs"], max_num_batched_tokens=p["max_num_batched_tokens"],
              compilation_cache_dir=compilation_cache_dir)
    return llm, time.perf_counter() - start


def decode_item(engine, args, ceilings, batch: int, p: dict) -> dict:
    from jaxllm.bench import roofline
    from jaxllm.bench.latency import measure_decode_step

    result = measure_decode_step(engine, batch, p["context_len"], p["decode_steps"])
    floor = roofline.decode_step_floor(args, batch, p["context_len"] + p["decode_steps"] // 2,
                                       ceilings, _storage(p))
    result.update(floor_ms=floor["floor_s"] * 1e3, bound=floor["bound"],
                  fraction_of_floor=floor["floor_s"] * 1e3 / result["median_step_ms"],
                  output_tokens_per_s=batch * 1e3 / result["median_step_ms"])
    return result


def throughput_item(llm, args, ceilings, workload, p: dict) -> dict:
    from jaxllm.bench import roofline
    from jaxllm.bench.datasets import random_requests
    from jaxllm.bench.throughput import run_throughput

    input_len, output_len, num_prompts = workload
    requests = random_requests(num_prompts, input_len, output_len, args.vocab_size, seed=0)
    result = run_throughput(llm, requests, use_tqdm=False)
    floor = roofline.workload_floor(args, [r.prompt_len for r in requests],
                                    [r.expected_output_len for r in requests], p["max_num_seqs"],
                                    ceilings, _storage(p))
    result.update(input_len=input_len, output_len=output_len, floor_s=floor["floor_s"],
                  bound=floor["bound"], fraction_of_floor=floor["floor_s"] / result["elapsed_time"],
                  floor_output_tokens_per_s=result["total_output_tokens"] / floor["floor_s"])
    return result


def closed_loop_item(engine, vocab_size: int, concurrency: int, p: dict) -> dict:
    """At most `concurrency` requests in flight; a new one enters when one finishes."""
    from jaxllm.bench.datasets import random_requests
    from jaxllm.sampling_params import SamplingParams

    input_len, output_len = p["concurrency_workload"]
    requests = random_requests(max(2 * concurrency, 8), input_len, output_len, vocab_size,
                               seed=concurrency)
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=output_len)
    pending, in_flight, output_tokens = list(enumerate(requests)), 0, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, r = pending.pop(0)
            engine.add_request(f"conc-{concurrency}-{i}", r.prompt, params)
            in_flight += 1
        for output in engine.step():
            if output.finished:
                in_flight -= 1
                output_tokens += len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "num_requests": len(requests), "elapsed_time": elapsed,
            "output_tokens_per_second": output_tokens / elapsed,
            "requests_per_second": len(requests) / elapsed}


def _storage(p: dict):
    from jaxllm.bench.roofline import Storage
    size = 4 if p["dtype"] == "float32" else 2
    return Storage(size, size, size)


def _model_path(p: dict, out: str) -> str:
    """A preset name, or (smoke) a directory holding the tiny config for dummy weights."""
    if p["model"] != "tiny":
        return p["model"]
    path = os.path.join(out, "smoke_model")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(p["hf_config"], f)
    return path


def main() -> None:
    a = worker_args()

    import jax

    from jaxllm.bench import roofline
    from jaxllm.models.args import ModelArgs

    p = plan(a.smoke, a.scale, a.long)
    rec = Recorder(os.path.join(a.out, "jaxllm.json"), a.deadline)
    rec.run("env", lambda: {"jax": jax.__version__, "backend": jax.default_backend(),
                            "device": jax.devices()[0].device_kind,
                            "num_devices": jax.device_count(), "plan": p})
    kw = {} if not a.smoke else dict(copy_bytes=16 << 20, matmul_n=256, reps=3)
    ceil = rec.run("ceilings", lambda: roofline.measure_ceilings(p["dtype"], **kw).as_dict())
    if ceil is None or "error" in ceil:  # go on with H200 datasheet figures, marked as such
        ceil = rec.results["ceilings_used"] = dict(
            hbm_bytes_per_s=4.8e12, gemv_bytes_per_s=4.8e12, matmul_flops_per_s=989e12,
            device="H200 datasheet (measurement failed)", dtype=p["dtype"])
    ceilings = roofline.Ceilings(**{k: v for k, v in ceil.items() if k != "wall_s"})
    args = ModelArgs.from_hf_config(p["hf_config"])
    model = _model_path(p, a.out)
    # a cache of this run's own, so that the first start is cold even where another process
    # (a serving sweep on the next GPU) fills the default one
    cache_dir = tempfile.mkdtemp(prefix="jaxllm_jit_")
    atexit.register(shutil.rmtree, cache_dir, ignore_errors=True)
    holder = {}

    def start_engine() -> dict:
        holder["llm"], seconds = make_llm(p, model, cache_dir)
        engine = holder["llm"].llm_engine
        return {"startup_s": seconds,
                "num_blocks": engine.num_blocks, "buckets": engine.runner.buckets}

    rec.run("startup", start_engine)
    if "llm" not in holder:
        return
    llm = holder["llm"]
    for batch in p["decode_batches"]:
        rec.run(f"decode_b{batch}", lambda b=batch: decode_item(llm.llm_engine, args, ceilings,
                                                                  b, p))
    def throughput(llm, workloads) -> None:
        for workload in workloads:
            rec.run(f"throughput_{workload_name(*workload[:2])}",
                    lambda w=workload: throughput_item(llm, args, ceilings, w, p))

    # the long workload (minutes) goes last, so that a tight budget skips only it
    short = [w for w in p["throughput"] if w[1] < 1000]
    throughput(llm, short)
    for c in p["concurrency"]:
        rec.run(f"concurrency_{c}", lambda c=c: closed_loop_item(llm.llm_engine, args.vocab_size,
                                                                 c, p))
    del llm, holder["llm"]
    gc.collect()

    def restart() -> dict:  # the compilation cache is warm now
        holder["llm"], seconds = make_llm(p, model, cache_dir)
        return {"startup_s": seconds}

    rec.run("startup_warm_cache", restart)
    if "llm" in holder:
        throughput(holder["llm"], [w for w in p["throughput"] if w not in short])


if __name__ == "__main__":
    main()
