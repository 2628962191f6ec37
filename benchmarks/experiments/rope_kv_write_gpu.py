"""One GPU call, under a minute: a step's rope, q/k/v split and KV write over 32 layers of the
Llama-3.1-8B shape (8 KV heads, 4 query heads each, head_dim 128, bf16 pages), as the product
runs them (XLA's fusions of apply_rope and the scatter) against the fused candidate kernel
(experiments/rope_kv_write.py), at 1, 16 and 256 tokens.

    python benchmarks/experiments/rope_kv_write_gpu.py --out DIR
    python benchmarks/experiments/rope_kv_write_gpu.py --out DIR --cpu   # interpreted, tiny

Each layer's input is what the FP8 one-token GEMV hands the layer: fp32 partial sums over two K
splits of the fused qkv projection, summed and rounded to bf16 by XLA (into the rope's fusions on
the product's path; materialised before the candidate's custom call). The caches (donated, 2,048
16-token pages a layer) take the tokens at random distinct slots. Both programs are checked
against rope_kv_write_reference first (q and the written slots; max |diff| over max |ref|).
Timing: GPU kernel durations from a profiler trace (quant_linear_gpu.py's run_times; XLA's
command buffers off), summed per run, the median of RUNS runs; kernels a run are counted.
DIR gets rope_kv_write.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [BENCHMARKS, os.path.dirname(BENCHMARKS), os.path.dirname(os.path.abspath(__file__))]
# before jax starts (it sets XLA_FLAGS): every kernel launched on its own, so the trace has each
import quant_linear_gpu as qlg  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from rope_kv_write import rope_kv_write, rope_kv_write_reference  # noqa: E402

SHAPE = {"gpu": dict(layers=32, kv_heads=8, group=4, head_dim=128, pages=2048, tokens=(1, 16, 256)),
         "cpu": dict(layers=2, kv_heads=2, group=2, head_dim=64, pages=16, tokens=(1, 5))}
PAGE = 16
SPLITS = 2
RUNS = 5


def inputs(s: dict, tokens: int, seed: int):
    """Per layer fp32 partials [SPLITS, T, Hkv * (G + 2) * D]; cos, sin; distinct slots; caches."""
    rng = np.random.default_rng(seed)
    width = s["kv_heads"] * (s["group"] + 2) * s["head_dim"]
    partials = [jnp.asarray(rng.standard_normal((SPLITS, tokens, width)), jnp.float32)
                for _ in range(s["layers"])]
    angles = rng.uniform(0, 100, (tokens, 1, s["head_dim"] // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(PAGE, s["pages"] * PAGE))[:tokens], jnp.int32)
    shape = (s["pages"], PAGE, s["kv_heads"], s["head_dim"])
    caches = [(jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
              for _ in range(s["layers"])]
    return partials, cos, sin, slots, caches


def step(kernel, s: dict, interpret: bool):
    """(partials, cos, sin, slots, caches) -> (q per layer, caches): every layer's rope and
    write, by `kernel` ("xla": the product's ops; "fused": the candidate)."""
    def run(partials, cos, sin, slots, caches):
        qs, out = [], []
        for p, (k_cache, v_cache) in zip(partials, caches):
            qkv = jnp.sum(p, axis=0).astype(jnp.bfloat16).reshape(
                p.shape[1], s["kv_heads"], s["group"] + 2, s["head_dim"])
            if kernel == "xla":
                q, k_cache, v_cache = rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache,
                                                              slots)
            else:
                q, k_cache, v_cache = rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots,
                                                    interpret=interpret)
            qs.append(q)
            out.append((k_cache, v_cache))
        return qs, out
    return jax.jit(run, donate_argnums=(4,))


def check(s: dict, tokens: int, interpret: bool) -> float:
    """The candidate's q and written K/V rows against the reference's, one layer."""
    one = dict(s, layers=1)
    partials, cos, sin, slots, caches = inputs(one, tokens, 1)
    want_q, want_caches = step("xla", one, interpret)(partials, cos, sin, slots, caches)
    partials, cos, sin, slots, caches = inputs(one, tokens, 1)
    got_q, got_caches = step("fused", one, interpret)(partials, cos, sin, slots, caches)
    flat = lambda c: np.asarray(c, np.float32).reshape(-1, *c.shape[2:])[np.asarray(slots)]  # noqa: E731
    pairs = [(got_q[0], want_q[0])] + [(flat(g), flat(w)) for g, w in
                                       zip(got_caches[0], want_caches[0])]
    return max(float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)))
                     / np.max(np.abs(np.asarray(w, np.float32)))) for g, w in pairs)


def time_runs(programs: list[dict], s: dict, trace_dir: str) -> None:
    """Runs each program RUNS times in annotated windows (the caches fed back, donated)."""
    for p in programs:  # compiled and run once before the trace
        jax.block_until_ready(p["fn"](*inputs(s, p["tokens"], 0)))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i, p in enumerate(programs):
            partials, cos, sin, slots, caches = inputs(s, p["tokens"], 0)
            for r in range(RUNS):
                with jax.profiler.TraceAnnotation(f"quant_linear:{i}:{r}"):
                    _, caches = p["fn"](partials, cos, sin, slots, caches)
                    jax.block_until_ready(caches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    where = "cpu" if args.cpu else "gpu"
    interpret = jax.default_backend() != "gpu"
    s = SHAPE[where]
    rows, programs = [], []
    for tokens in s["tokens"]:
        err = check(s, tokens, interpret)
        for kernel in ("xla", "fused"):
            programs.append(dict(kernel=kernel, tokens=tokens, err=err,
                                 fn=step(kernel, s, interpret)))
    with tempfile.TemporaryDirectory() as trace_dir:
        time_runs(programs, s, trace_dir)
        times = qlg.run_times(trace_dir)
    for i, p in enumerate(programs):
        runs = [times[i, r] for r in range(RUNS) if (i, r) in times]
        on_gpu = any(t["kernels"] for t in runs)
        us = statistics.median(t["gpu_us"] if on_gpu else t["wall_us"] for t in runs)
        rows.append(dict(kernel=p["kernel"], tokens=p["tokens"], layers=s["layers"],
                         err=p["err"], us_per_step=us,
                         kernels_per_step=statistics.median(t["kernels"] for t in runs),
                         timer="gpu kernels" if on_gpu else "wall"))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "rope_kv_write.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "shape": s, "rows": rows}, f, indent=1)
    for tokens in s["tokens"]:
        cells = {r["kernel"]: r for r in rows if r["tokens"] == tokens}
        print(f"tokens {tokens:>3}: " + " | ".join(
            f"{k} {r['us_per_step']:.1f} us ({r['kernels_per_step']:.0f} kernels)"
            for k, r in cells.items()) + f" | err {cells['fused']['err']:.1e}")


if __name__ == "__main__":
    main()
