"""One GPU call, ~1 minute: the attention of a 1000/1000 run's mixed step on float8 pages
(ncu_kernels.PREFILL_STEP: 500 decodes at 1,200 tokens and two prompts), the entry's default
(on Hopper: the prompts on the Mosaic kernel over 16-bit copies of their pages, the decodes on
Triton) against implementation="triton" (both on the Triton kernel, two launches). Each output
is checked against the reference first (all live rows, and the prompts' rows alone), then each
variant is timed as the GPU kernels one call runs: a profiler trace of RUNS calls, every kernel
of a call summed, the median call. A call's kernels include the page ids and tile metadata
that a model step computes once for all its layers. Then a step whose prompts overflow the
16-bit copies (OVERFLOW: 27 of 40 short prompts past the staged sequences' pages, and one past
all of them) is checked against the reference as well, so that the Triton launch for the
prompts not staged runs with work.

    python benchmarks/experiments/prompts_attention_gpu.py --out DIR [--decode-programs N ...]

--decode-programs adds a variant of the default for each N: its decodes' launch with N programs
along the q blocks, each looping over its share (as the launch for the prompts not staged does).

DIR gets prompts_attention.json: per variant its errors, the median us of a call and the
kernels of one call (name, us).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import ncu_kernels  # noqa: E402  (through gemv_gpu: every kernel launched on its own)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from profile_decode import annotated_gpu_events  # noqa: E402

from pallas_kernels.bench import HEADS, attn_args, random_batch, rel_err  # noqa: E402
from pallas_kernels import ragged_paged_attention as rpa  # noqa: E402
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,  # noqa: E402
                                                   ragged_paged_attention_reference)

RUNS = 20
SCALES = dict(sm_scale=0.088, k_scale=2.0)  # prefill_batch's float8 pages hold K / 2
VARIANTS = {"default": {}, "triton": dict(implementation="triton")}
OVERFLOW = ([1] * 300 + [8] * 40 + [500], [1200] * 300 + [300] * 40 + [6000])


def compile_looped_decodes(args, programs: int):
    """The default entry compiled with its decodes' launch given `programs` q-block programs."""
    triton_attention = rpa._triton_attention

    def looped(*a, only=None, **kw):
        if only == "decode":
            kw["q_block_programs"] = programs
        return triton_attention(*a, only=only, **kw)

    rpa._triton_attention = looped
    try:
        return jax.jit(functools.partial(ragged_paged_attention, **SCALES)).lower(*args).compile()
    finally:
        rpa._triton_attention = triton_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--decode-programs", type=int, nargs="*", default=[])
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    args = attn_args(ncu_kernels.prefill_batch())
    q_lens = ncu_kernels.PREFILL_STEP[0]
    live, decodes = sum(q_lens), q_lens.count(1)
    ref = ragged_paged_attention_reference(args[0].astype(jnp.float32), *args[1:], **SCALES)
    compiled = {name: jax.jit(functools.partial(ragged_paged_attention, **SCALES, **kw))
                .lower(*args).compile() for name, kw in VARIANTS.items()}
    for programs in cli.decode_programs:
        compiled[f"decode_programs_{programs}"] = compile_looped_decodes(args, programs)
    rows = {}
    for name, call in compiled.items():
        out = call(*args)
        rows[name] = {"rel_err": rel_err(out[:live], ref[:live]),
                      "rel_err_prompts": rel_err(out[decodes:live], ref[decodes:live])}
    trace_dir = os.path.join(cli.out, "trace")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i, call in enumerate(compiled.values()):
            for r in range(RUNS):
                with jax.profiler.TraceAnnotation(f"prompts:{i}:{r}"):
                    jax.block_until_ready(call(*args))
    calls = annotated_gpu_events(trace_dir, "prompts:")
    for i, name in enumerate(compiled):
        runs = [calls[f"{i}:{r}"][1] for r in range(RUNS) if f"{i}:{r}" in calls]
        rows[name].update(us=statistics.median(sum(us for _, us in k) for k in runs),
                          kernels=[(kernel, round(us, 1)) for kernel, us in runs[-1]])
        short = {k: v for k, v in rows[name].items() if k != "kernels"}
        print(json.dumps({"variant": name, **short, "kernels": len(runs[-1]),
                          "top": sorted(rows[name]["kernels"], key=lambda kv: -kv[1])[:5]}),
              flush=True)
    b = random_batch(jax.random.key(1), *OVERFLOW, num_tokens=2048, **HEADS)
    args = attn_args(dict(b, k_cache=(b["k_cache"] * 0.5).astype(jnp.float8_e4m3fn),
                          v_cache=b["v_cache"].astype(jnp.float8_e4m3fn)))
    live = sum(OVERFLOW[0])
    ref = ragged_paged_attention_reference(args[0].astype(jnp.float32), *args[1:], **SCALES)
    for name, kw in VARIANTS.items():
        out = jax.jit(functools.partial(ragged_paged_attention, **SCALES, **kw))(*args)
        rows[name]["rel_err_overflow"] = rel_err(out[:live], ref[:live])
        print(json.dumps({"variant": name, "rel_err_overflow": rows[name]["rel_err_overflow"],
                          "finite": bool(jnp.isfinite(out[:live]).all())}), flush=True)
    with open(os.path.join(cli.out, "prompts_attention.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
