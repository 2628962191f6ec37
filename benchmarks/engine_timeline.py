"""Where an offline run's wall time goes: the host's stages of every engine step (schedule, the
runner's launch, waiting for the device, fetching tokens, the scheduler's update, outputs) and
Python's garbage collections, from timers around the engine's methods; every step's row (its
stages, tokens and sequences) in steps_<variant>_<n>.jsonl beside the summary.

With async scheduling the host overlaps the device: a run is host-bound when the host seldom
waits for the device (the `wait` column stays near zero while steps take longer than the
device needs), device-bound when it waits at most steps.

    python benchmarks/engine_timeline.py --out DIR --workload 1000,1000,1000 --max-num-seqs 512 \
        --quantization fp8 --kv-cache-dtype fp8
    python benchmarks/engine_timeline.py --cpu --out DIR --workload 100,100,64 \
        --max-model-len 256    # tiny random model: the host's stages and collections
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import time
from collections import defaultdict

import jax
import numpy as np

from jaxllm import LLM
from jaxllm.sampling_params import SamplingParams

STAGES = ("schedule", "launch", "wait", "collect", "update", "outputs")
HOST_BOUND_WAIT_S = 2e-4


class Timeline:
    """Per-step seconds of each stage, and the garbage collector's pauses; with a profiler,
    cProfile runs inside the host stages only (not while the host waits for the device)."""

    def __init__(self, profiler: cProfile.Profile | None = None) -> None:
        self.profiler = profiler
        self.steps: list[dict] = []
        self.gc_pauses: dict[int, list[float]] = defaultdict(list)  # generation -> seconds
        self._gc_start = 0.0

    def attach(self, llm: LLM) -> None:
        engine = llm.llm_engine
        runner, scheduler = engine.runner, engine.scheduler
        self._wrap(scheduler, "schedule", "schedule", new_step=True)
        self._wrap(runner, "launch", "launch")
        self._wrap(runner, "collect", "collect", before=self._wait)
        self._wrap(scheduler, "update_from_output", "update")
        self._wrap(engine.output_processor, "process", "outputs")
        gc.callbacks.append(self._on_gc)

    def detach(self, llm: LLM) -> None:
        gc.callbacks.remove(self._on_gc)
        engine = llm.llm_engine
        for obj in (engine.runner, engine.scheduler, engine.output_processor):
            for method in ("schedule", "launch", "collect", "update_from_output", "process"):
                vars(obj).pop(method, None)

    def _wait(self, launched) -> None:
        start = time.perf_counter()
        jax.block_until_ready(launched.sampled.token_ids)
        self.steps[-1]["wait"] += time.perf_counter() - start

    def _wrap(self, obj, method: str, stage: str, new_step: bool = False, before=None) -> None:
        original = getattr(obj, method)

        def timed(*args, **kwargs):
            if before is not None:
                before(*args)
            start = time.perf_counter()
            if self.profiler is not None:
                self.profiler.enable()
            out = original(*args, **kwargs)
            if self.profiler is not None:
                self.profiler.disable()
            if new_step:
                self.steps.append(dict.fromkeys(STAGES, 0.0) | {
                    "tokens": out.total_num_scheduled_tokens, "seqs": out.num_reqs})
            self.steps[-1][stage] += time.perf_counter() - start
            return out
        setattr(obj, method, timed)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_pauses[info["generation"]].append(time.perf_counter() - self._gc_start)

    def summary(self, wall_s: float) -> dict:
        steps = [s for s in self.steps if s["seqs"]]
        decode = [s for s in steps if s["tokens"] == s["seqs"]]
        def mean_ms(rows):
            return {k: round(1e3 * float(np.mean([r[k] for r in rows])), 3) if rows else None
                    for k in STAGES}
        totals = {k: round(sum(s[k] for s in steps), 3) for k in STAGES}
        # the host's own steps: the device finished before the host asked for the tokens
        host_bound = [s for s in steps if s["wait"] < HOST_BOUND_WAIT_S]
        return dict(wall_s=round(wall_s, 3), steps=len(steps), decode_steps=len(decode),
                    host_bound_steps=len(host_bound),
                    host_bound_s=round(sum(sum(s[k] for k in STAGES) for s in host_bound), 3),
                    total_s=totals, host_s=round(sum(totals.values()) - totals["wait"], 3),
                    gc_s=round(sum(map(sum, self.gc_pauses.values())), 3),
                    gc_by_generation={g: dict(count=len(p), s=round(sum(p), 3),
                                              max_ms=round(1e3 * max(p), 2))
                                      for g, p in sorted(self.gc_pauses.items())},
                    mean_ms_all=mean_ms(steps), mean_ms_decode=mean_ms(decode),
                    mean_ms_mixed=mean_ms([s for s in steps if s["tokens"] > s["seqs"]]))


def run(llm: LLM, num: int, input_len: int, output_len: int, variant: str, seed: int,
        out_dir: str) -> dict:
    """One offline run; variant: plain, gc-freeze (gc.freeze() first, as servers do after
    start-up) or cprofile (the host stages under cProfile; stats in out_dir). Each run's
    prompts are its own (seed), so no run reads another's prefix cache."""
    rng = np.random.default_rng(seed)
    high = min(30000, llm.input_processor.vocab_size)
    prompts = [{"prompt_token_ids": rng.integers(10, high, input_len).tolist()}
               for _ in range(num)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    timeline = Timeline(cProfile.Profile() if variant == "cprofile" else None)
    timeline.attach(llm)
    gc.collect()
    if variant == "gc-freeze":
        gc.freeze()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    gc.unfreeze()
    timeline.detach(llm)
    if timeline.profiler is not None:
        path = os.path.join(out_dir, "host_stages.pstats")
        timeline.profiler.dump_stats(path)
        for order in ("tottime", "cumulative"):
            pstats.Stats(path).sort_stats(order).print_stats(35)
    with open(os.path.join(out_dir, f"steps_{variant}_{seed}.jsonl"), "w") as f:
        f.writelines(json.dumps(step) + "\n" for step in timeline.steps)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(variant=variant, output_tok_per_s=round(tokens / wall, 1),
                **timeline.summary(wall))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny random model (a test)")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--workload", default="1000,1000,1000", help="IN,OUT,PROMPTS")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--num-gpu-blocks-override", type=int,
                        help="KV blocks, not sized from free memory")
    parser.add_argument("--variants", default="plain",
                        help="comma-separated runs in one engine: plain, gc-freeze, cprofile")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    input_len, output_len, num = map(int, cli.workload.split(","))
    kw = dict(max_num_seqs=cli.max_num_seqs, quantization=cli.quantization,
              kv_cache_dtype=cli.kv_cache_dtype, attention_backend=cli.attention_backend,
              num_gpu_blocks_override=cli.num_gpu_blocks_override)
    if cli.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = cli.max_num_batched_tokens
    if cli.cpu:
        from quant_gpu import _tiny_llama_dir
        llm = LLM(_tiny_llama_dir(), max_model_len=cli.max_model_len, enforce_eager=True, **kw)
    else:
        llm = LLM(cli.model, load_format="dummy", dtype="bfloat16",
                  max_model_len=cli.max_model_len, **kw)
    for seed, variant in enumerate(cli.variants.split(","), 1):
        result = dict(workload=cli.workload, config=kw,
                      **run(llm, num, input_len, output_len, variant, seed, cli.out))
        print(json.dumps(result), flush=True)
        with open(os.path.join(cli.out, "timeline.json"), "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
