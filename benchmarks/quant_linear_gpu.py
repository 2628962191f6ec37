"""One GPU call, ~1 minute: each Llama-3.1-8B projection alone, per weight kind and token count,
timed by the GPU kernels' own durations in a profiler trace, to choose how each kind runs per
bucket (the engine's batch-1 FP8 and int4 steps measured far from their floors:
docs/lab/2026-12-01-session9.md).

    python benchmarks/quant_linear_gpu.py --out DIR          # a GPU
    python benchmarks/quant_linear_gpu.py --out DIR --cpu    # tiny shapes, to test the script

Projections (K -> N): qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672,
down 14336 -> 4096. Tokens T: 1, 8, 16 (the engine's smallest bucket: batch-1 decode), 32, 128,
2048 (a prefill bucket).
Kinds:
- bf16: x @ w;
- fp8 W8A8: x quantised per token, one FP8 x FP8 dot (cuBLAS), both scales (models/quant.py);
- int4: pallas_kernels/quant_matmul.py on random packed weights, group 128;
- fp8 block: a block-wise checkpoint's weight (128 x 128 blocks): x quantised per token and
  group of 128, pallas_kernels/fp8_block_matmul.py (models/quant.py); its rows also carry the
  relative error of the first call's output against the kernel's jnp reference.
Then a sweep of block_n x num_warps for the int4 kernel at T 1 and 8 on gate_up and down.

Timing: a jitted program calls the projection once on each of several weight copies (together
over 4x the L2, so each call reads its weights from HBM), each call waiting for the last one's
output (an optimization barrier: nothing merged or overlapped). Run under jax.profiler.trace,
each run inside a named host annotation; the GPU kernels that ran within a run's annotation are
summed per call (the median over runs); a run whose trace holds fewer GPU kernels than calls is
an error, not a time. XLA's command buffers are off: under them the trace held one call's
kernels a run. Wall-clock timing of such short calls carries ~15-30 us of dispatch each, more
than the kernels themselves. Programs compile in parallel threads before the trace. % floor: the call's floor (weight + activation bytes over the measured copy
bandwidth, or FLOPs over the matmul rate) over its time. DIR gets quant_linear.json; tables
print last. --cpu: no GPU kernels in the trace, so each run's wall time (a test of the script).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import math
import os
import statistics
import tempfile
import time

# before jax starts: every kernel launched on its own, so the profiler traces each one
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxllm.models import quant  # noqa: E402
from pallas_kernels import fp8_block_matmul, quant_matmul  # noqa: E402
from pallas_kernels.ceilings import measure_ceilings  # noqa: E402
from profile_decode import annotated_gpu_events  # noqa: E402

SHAPES = {"gpu": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                  "down": (14336, 4096)},
          "cpu": {"qkv": (256, 384), "down": (512, 256)}}
TOKENS = {"gpu": (1, 8, 16, 32, 128, 2048), "cpu": (1, 8)}
KINDS = ("bf16", "fp8 W8A8", "int4", "fp8 block")
PALLAS = {"int4": quant_matmul.int4_matmul}
STORAGE = {"bf16": "bf16", "fp8 W8A8": "fp8", "int4": "int4", "fp8 block": "fp8-block"}
SWEEP = {"gpu": dict(block_n=(64, 128, 256), num_warps=(4, 8), tokens=(1, 8),
                     shapes=("gate_up", "down")),
         "cpu": dict(block_n=(32, 64), num_warps=(4,), tokens=(1,), shapes=("down",))}
WEIGHT_SPAN = {"gpu": 256 << 20, "cpu": 0}  # bytes of weight copies a program cycles through
RUNS = 5
GROUP = 128


def default_tiles(kind: str, tokens: int, k: int, n: int) -> dict:
    """The block_n and num_warps a Pallas kernel takes when not given them."""
    params = inspect.signature(PALLAS[kind]).parameters
    block_n = params["block_n"].default or quant_matmul.default_block_n(tokens, k, n)
    return {"block_n": block_n, "num_warps": params["num_warps"].default}


def weight_bytes(storage: str, k: int, n: int) -> float:
    return k * n * {"bf16": 2.0, "fp8": 1.0, "int4": 0.5 + 3 / GROUP,
                    "fp8-block": 1.0 + 4 / GROUP}[storage]


def make_weights(storage: str, k: int, n: int, copies: int, key) -> list:
    """`copies` random weights (bf16, fp8 or int4) for a [K, N] projection, as a call takes
    them."""
    out = []
    for i in range(copies):
        sub = jax.random.fold_in(key, i)
        if storage == "int4":
            out.append((jax.random.bits(sub, (k // 8, n), jnp.uint32).view(jnp.int32),
                        jnp.full((k // GROUP, n), 2e-3, jnp.bfloat16),
                        jnp.full((k // GROUP, n), 8, jnp.uint8)))
            continue
        w = (0.02 * jax.random.normal(sub, (k, n), jnp.float32)).astype(jnp.bfloat16)
        if storage == "fp8-block":  # the channel scales, varied per group
            fp8 = quant.quantize_fp8(w)
            groups = jax.random.uniform(sub, (n, k // GROUP), jnp.float32, 0.5, 2.0)
            out.append(quant.Fp8BlockWeight(fp8.values, fp8.scale[:, None] * groups, GROUP))
            continue
        out.append(w if storage == "bf16" else quant.quantize_fp8(w))
    return out


def projection(kind: str, interpret: bool, tiles: dict):
    """(x [T, K], one weight) -> [T, N] for a kind; tiles: the Pallas kernel's block_n and
    num_warps (its defaults when empty)."""
    if kind == "bf16":
        return lambda x, w: x @ w
    if kind == "fp8 W8A8":
        return quant._fp8_w8a8
    if kind == "fp8 block":
        return quant.linear
    return lambda x, w: quant_matmul.int4_matmul(x, *w, interpret=interpret, **tiles)


def chain(call):
    """One call per weight copy, each waiting for the last one's output. Every output is
    returned: an output the barrier alone holds is dead, and XLA drops its call."""
    def run(x, ws):
        ys = []
        for w in ws:
            y = call(x, w)
            x, y = jax.lax.optimization_barrier((x, y))
            ys.append(y)
        return ys
    return run


def variants(where: str) -> list[dict]:
    """Every program to time: the kinds x projections x tokens, then the sweep's tile choices
    (the defaults' cell is in the first list)."""
    out = [dict(kind=kind, proj=proj, tokens=t, tiles={})
           for proj in SHAPES[where] for kind in KINDS for t in TOKENS[where]]
    sweep = SWEEP[where]
    tiles = [dict(block_n=bn, num_warps=nw) for bn in sweep["block_n"] for nw in sweep["num_warps"]]
    for kind in PALLAS:
        out += [dict(kind=kind, proj=proj, tokens=t, tiles=tile, sweep=True)
                for proj in sweep["shapes"] for t in sweep["tokens"] for tile in tiles
                if tile != default_tiles(kind, t, *SHAPES[where][proj])]
    return out


def compile_all(programs: list[dict], args_of, interpret: bool) -> float:
    """Lowers and compiles every program in threads (XLA's compiler releases the GIL); sets
    each one's "compiled" (or "error"); returns the wall seconds."""
    def build(p):
        fn = jax.jit(chain(projection(p["kind"], interpret, p["tiles"])))
        return fn.lower(*args_of(p)).compile()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        futures = [pool.submit(build, p) for p in programs]
        for p, future in zip(programs, futures):
            try:
                p["compiled"] = future.result()
            except Exception as e:  # a failing variant is a row, not the end of the run
                p["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return time.perf_counter() - start


def trace_runs(programs: list[dict], args_of, trace_dir: str) -> None:
    """Runs each compiled program RUNS times under the profiler, each run in its own host
    annotation; sets each one's "windows" (host start, end in us) via the trace's events."""
    for p in programs:
        if "compiled" in p:
            jax.block_until_ready(p["compiled"](*args_of(p)))  # loads its kernels
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i, p in enumerate(programs):
            if "compiled" not in p:
                continue
            args = args_of(p)
            for r in range(RUNS):
                with jax.profiler.TraceAnnotation(f"quant_linear:{i}:{r}"):
                    jax.block_until_ready(p["compiled"](*args))


def run_times(trace_dir: str) -> dict[tuple[int, int], dict]:
    """(program, run) -> {"wall_us", "gpu_us", "kernels"}: its annotation's duration and the GPU
    stream events (kernels, copies) whose midpoint falls inside it."""
    out = {}
    for name, (wall, inside) in annotated_gpu_events(trace_dir, "quant_linear:").items():
        i, r = name.split(":")
        out[int(i), int(r)] = {"wall_us": wall, "gpu_us": sum(d for _, d in inside),
                               "kernels": len(inside)}
    return out


def row(p: dict, times: dict, index: int, ceilings, shapes) -> dict:
    k, n = shapes[p["proj"]]
    tiles = default_tiles(p["kind"], p["tokens"], k, n) if p["kind"] in PALLAS else {}
    base = {"kind": p["kind"], "proj": p["proj"], "k": k, "n": n, "tokens": p["tokens"],
            **tiles, **p["tiles"], "sweep": p.get("sweep", False)}
    if "error" in p:
        return {**base, "error": p["error"]}
    runs = [times[index, r] for r in range(RUNS) if (index, r) in times]
    on_gpu = any(t["kernels"] for t in runs)
    if on_gpu and min(t["kernels"] for t in runs) < p["calls"]:
        return {**base, "error": f"trace holds {[t['kernels'] for t in runs]} GPU kernels a run "
                                 f"for {p['calls']} calls: timing incomplete"}
    us = statistics.median((t["gpu_us"] if on_gpu else t["wall_us"]) / p["calls"] for t in runs)
    io_bytes = weight_bytes(STORAGE[p["kind"]], k, n) + 2 * p["tokens"] * (k + n)
    floor = max(io_bytes / ceilings.hbm_bytes_per_s,
                2 * p["tokens"] * k * n / ceilings.matmul_flops_per_s) * 1e6
    return {**base, "us": us, "floor_us": floor, "pct_floor": 100 * floor / us,
            "timer": "gpu kernels" if on_gpu else "wall",
            "kernels_per_call": runs[0]["kernels"] / p["calls"], "calls": p["calls"]}


def block_errors(programs: list[dict], args_of) -> dict[int, float]:
    """Program index -> the relative error of an fp8 block program's first output against the
    kernel's jnp reference (fp32) on the same quantised x."""
    out = {}
    for i, p in enumerate(programs):
        if p["kind"] != "fp8 block" or "compiled" not in p:
            continue
        x, ws = args_of(p)
        got = p["compiled"](x, ws)[0].astype(jnp.float32)
        xq, x_scale = quant.quantize_fp8_groups(x, GROUP)
        want = fp8_block_matmul.fp8_block_matmul_reference(xq, x_scale, ws[0].values,
                                                           ws[0].scale, GROUP, jnp.float32)
        out[i] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| proj | T | " + " | ".join(f"{k} us (% floor)" for k in KINDS) + " |",
             "|" + " --- |" * (2 + len(KINDS))]
    for proj, t in dict.fromkeys((r["proj"], r["tokens"]) for r in rows):
        cells = [next((f"{r['us']:.1f} ({r['pct_floor']:.0f}%)" for r in rows
                       if (r["kind"], r["proj"], r["tokens"]) == (kind, proj, t)), "-")
                 for kind in KINDS]
        lines.append(f"| {proj} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    lines = ["| kernel | proj | T | block_n | num_warps | us (% floor) |",
             "|" + " --- |" * 6]
    for r in sorted(rows, key=lambda r: (r["kind"], r["proj"], r["tokens"], r["us"])):
        lines.append(f"| {r['kind']} | {r['proj']} | {r['tokens']} | {r['block_n']} | "
                     f"{r['num_warps']} | {r['us']:.1f} ({r['pct_floor']:.0f}%) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    where = "cpu" if args.cpu else "gpu"
    interpret = jax.default_backend() != "gpu"
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compiles.append(secs)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    start = time.perf_counter()
    ceilings = (measure_ceilings("bfloat16", copy_bytes=1 << 20, matmul_n=128, reps=3)
                if args.cpu else measure_ceilings("bfloat16"))
    shapes, programs = SHAPES[where], variants(where)
    weights, xs = {}, {}
    for proj, (k, n) in shapes.items():
        for kind in dict.fromkeys(STORAGE.values()):
            copies = max(2, math.ceil(WEIGHT_SPAN[where] / weight_bytes(kind, k, n)))
            weights[proj, kind] = make_weights(kind, k, n, copies, jax.random.key(k * 7 + n))
        for t in TOKENS[where]:
            xs[t, k] = jax.random.normal(jax.random.key(t), (t, k), jnp.bfloat16)
    args_of = lambda p: (xs[p["tokens"], shapes[p["proj"]][0]],
                         weights[p["proj"], STORAGE[p["kind"]]])
    for p in programs:
        p["calls"] = len(args_of(p)[1])
    setup_s = time.perf_counter() - start
    compile_s = compile_all(programs, args_of, interpret)
    with tempfile.TemporaryDirectory() as trace_dir:
        trace_runs(programs, args_of, trace_dir)
        times = run_times(trace_dir)
    errors = block_errors(programs, args_of)
    rows = [{**row(p, times, i, ceilings, shapes),
             **({"rel_err": errors[i]} if i in errors else {})} for i, p in enumerate(programs)]
    for r in rows:
        print(json.dumps(r), flush=True)
    summary = {"device": ceilings.device, "ceilings": ceilings.as_dict(),
               "programs": len(programs), "backend_compiles": len(compiles),
               "setup_s": setup_s, "compile_wall_s": compile_s,
               "total_s": time.perf_counter() - start}
    with open(os.path.join(args.out, "quant_linear.json"), "w") as f:
        json.dump({**summary, "rows": rows}, f, indent=1)
    timed = [r for r in rows if "us" in r]
    print(f"\n{json.dumps(summary)}\n{ceilings.device}, copy "
          f"{ceilings.hbm_bytes_per_s / 1e9:.0f} GB/s")
    print(table([r for r in timed if not r["sweep"]]))
    sweep = SWEEP[where]
    print(sweep_table([r for r in timed if r["kind"] in PALLAS and r["proj"] in sweep["shapes"]
                       and r["tokens"] in sweep["tokens"]]))


if __name__ == "__main__":
    main()
