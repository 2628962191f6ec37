"""One GPU call, ~2 minutes a kind: a one-token GEMV at its defaults against the bf16 dot, on
Llama-3.1-8B's four projections, with a sweep of a kernel's tilings; every output checked
against its reference first.

    python benchmarks/experiments/gemv_gpu.py --weights int4|fp8 --out DIR [--budget-s 120] \
        [--sweep NAME=V,V ...]  # only these dimensions, e.g. num_stages=1,3 splits=1,0.5
    python benchmarks/experiments/gemv_gpu.py --weights int4|fp8 --out DIR --cpu  # tiny, interpreted

Projections (K -> N): qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down 14336 ->
4096; x bf16 [1, K].
- int4: the W4A16 GEMV (pallas_kernels/int4_gemv.py) and the tensor-core product kernel
  (quant_matmul.int4_matmul: one row padded to a 16-row tile) on random packed weights, group
  128, scales over a decade, asymmetric zero points; the GEMV's sweep: block_n 64 / 128 / 256 x
  num_warps 4 / 8 x num_stages 1 / 3 (pipelined_loop) x splits the default, half it, a quarter
  of it, twice it. Reference: quant_matmul.int4_matmul_reference.
- fp8: the W8A16 GEMV (pallas_kernels/fp8_gemv.py), also with the input RMSNorm inside it
  on qkv and gate/up (as the engine runs them); the GEMV's sweep: block_n 16 / 32 / 64 x
  block_k 256 / 512 x num_warps 4 / 8 x splits the default, half it, twice it (num_stages 1;
  deeper by --sweep). Reference: fp8_gemv.fp8_gemv_reference.
Both beside XLA's own dot on the same weights (the int4 or float8 values widened in its
prologue). First the swept kernel at each num_stages of the run on a shape ragged against its
tiles (RAGGED), against its reference: rows with `ragged`, untimed.
Counts that come to the same splits are timed once. err: max |out - ref| / max |ref| against the
reference on the same inputs (bf16: against its own fp32 product); a variant over 1e-2 is a row
with its error, not a time.

Timing as benchmarks/quant_linear_gpu.py (its chain, trace_runs and run_times): a jitted program
calls the projection once on each of several weight copies (over 256 MiB together, so each call
reads HBM, not L2), each call waiting for the last; GPU kernel durations from a profiler trace,
summed per call (a split's sum of partials included), the median over runs. % floor: the weight
bytes (int4: packed weights, scales, zeros; fp8: values and scales; bf16: the matrix) over the
measured copy bandwidth, over the time. Programs compile in threads, a batch at a time (the main
variants, then the sweep one projection at a time); a sweep batch that would start past
--budget-s is left out as `skipped` rows. DIR gets gemv_<weights>.json; the tables (per
projection and the layer's sum) print last. --cpu: interpret mode, no GPU kernels in the trace, so wall time per
call (a test of the script).
"""

from __future__ import annotations

import argparse
import itertools
import concurrent.futures
import json
import math
import os
import statistics
import sys
import tempfile
import time

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [BENCHMARKS, os.path.dirname(BENCHMARKS), os.path.dirname(os.path.abspath(__file__))]
# before jax starts (it sets XLA_FLAGS): every kernel launched on its own, so the trace has each
import quant_linear_gpu as qlg  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxllm.models import quant  # noqa: E402
from pallas_kernels import fp8_gemv, int4_gemv, quant_matmul  # noqa: E402
from pallas_kernels.ceilings import measure_ceilings  # noqa: E402

SHAPES = {"gpu": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                  "down": (14336, 4096)},
          "cpu": {"qkv": (256, 384), "down": (512, 200)}}
NORMED = ("qkv", "gate_up")  # the projections whose FP8 GEMV carries the input norm
SWEEP = {("int4", "gpu"): dict(block_n=(64, 128, 256), num_warps=(4, 8), num_stages=(1, 3),
                               splits=(1, 0.5, 0.25, 2)),
         ("int4", "cpu"): dict(block_n=(32, 64), num_warps=(4,), num_stages=(1,), splits=(1, 2)),
         # FP8's pipelined loops measured slower at every shape (docs/lab): deeper only by --sweep
         ("fp8", "gpu"): dict(block_n=(16, 32, 64), block_k=(256, 512), num_warps=(4, 8),
                              num_stages=(1,), splits=(1, 0.5, 2)),
         ("fp8", "cpu"): dict(block_n=(16, 32), block_k=(64,), num_warps=(4,), num_stages=(1,),
                              splits=(1, 2))}
# per weights: the variants timed at their defaults, the swept kernel
MAIN = {"int4": ("bf16", "int4_matmul", "int4_gemv", "xla_int4"),
        "fp8": ("bf16", "fp8_gemv", "fp8_gemv_norm", "xla_w8a16")}
SWEPT = {"int4": "int4_gemv", "fp8": "fp8_gemv"}
WEIGHT_SPAN = {"gpu": 256 << 20, "cpu": 0}  # bytes of weight copies a program cycles through
GROUP = 128
MAX_ERR = 1e-2  # bf16 output rounding is 2^-8; a broken kernel errs by far more
EPS = 1e-5


def weight_bytes(kind: str, k: int, n: int) -> int:
    if kind == "bf16":
        return 2 * k * n
    if kind.startswith("fp8") or kind == "xla_w8a16":
        return k * n + 4 * n  # float8 values, an fp32 scale a channel
    return k * n // 2 + 3 * (k // GROUP) * n  # packed nibbles; a bf16 scale and a uint8 zero


def make_weights(kind: str, k: int, n: int, copies: int, key) -> list:
    """`copies` random weights: bf16 [K, N]; int4 (qweight, scales, zeros) in quant_matmul's
    layout with scales over a decade and zero points over 0..15; fp8 (values [N, K], scale [N],
    an RMSNorm weight [K])."""
    out = []
    for i in range(copies):
        kq, ks, kz = jax.random.split(jax.random.fold_in(key, i), 3)
        if kind == "bf16":
            out.append((0.02 * jax.random.normal(kq, (k, n))).astype(jnp.bfloat16))
        elif kind == "fp8":
            w = quant.quantize_fp8((0.02 * jax.random.normal(kq, (n, k))).astype(jnp.bfloat16)
                                   .T)  # quantised per output channel
            out.append((w.values.reshape(n, k), w.scale.reshape(n),
                        (1 + 0.1 * jax.random.normal(ks, (k,))).astype(jnp.bfloat16)))
        else:
            out.append((jax.random.bits(kq, (k // 8, n), jnp.uint32).view(jnp.int32),
                        jax.random.uniform(ks, (k // GROUP, n), jnp.float32, 1e-3, 1e-2)
                        .astype(jnp.bfloat16),
                        jax.random.randint(kz, (k // GROUP, n), 0, 16).astype(jnp.uint8)))
    return out


def xla_int4_weights(qweight, scales, zeros) -> tuple:
    """quant_matmul's packed words -> XLA's own int4 layout: the nibbles less 8 as int4
    [K // group, group, N], with the same scales and zeros."""
    q = (quant_matmul.unpack_int4(qweight).astype(jnp.int32) - 8).astype(jnp.int4)
    return q.reshape(scales.shape[0], -1, q.shape[1]), scales, zeros


def xla_int4(x, w):
    """x [M, K] @ the int4 weights by XLA alone: a dot per group on the int4 values widened in
    its prologue, then the scales and zero points (s (n - z) = s (q + 8 - z), q = n - 8)."""
    q, s, z = w
    xg = x.reshape(x.shape[0], q.shape[0], q.shape[1])
    part = jnp.einsum("mgk,gkn->mgn", xg, q.astype(x.dtype), preferred_element_type=jnp.float32)
    xsum = jnp.sum(xg.astype(jnp.float32), axis=2)[..., None]
    y = s.astype(jnp.float32) * (part - (z.astype(jnp.float32) - 8) * xsum)
    return jnp.sum(y, axis=1).astype(x.dtype)


def projection(p: dict, interpret: bool):
    """(x [1, K], one weight) -> [1, N] for a variant."""
    kind, tiles = p["kind"], p["tiles"]
    if kind == "bf16":
        return lambda x, w: x @ w
    if kind == "xla_int4":
        return xla_int4
    if kind == "xla_w8a16":  # the float8 values widened in the dot's prologue
        return lambda x, w: (jnp.dot(x, w[0].astype(x.dtype).T, preferred_element_type=jnp.float32)
                             * w[1]).astype(x.dtype)
    if kind == "int4_matmul":
        return lambda x, w: quant_matmul.int4_matmul(x, *w, interpret=interpret)
    if kind == "int4_gemv":
        return lambda x, w: int4_gemv.int4_gemv(x, *w, interpret=interpret, **tiles)
    if kind == "fp8_gemv_norm":
        return lambda x, w: fp8_gemv.fp8_gemv(x, w[0], w[1], norm_weight=w[2], eps=EPS,
                                              interpret=interpret, **tiles)
    return lambda x, w: fp8_gemv.fp8_gemv(x, w[0], w[1], interpret=interpret, **tiles)


def sweep_tiles(weights: str, k: int, n: int, tile: dict, factor: float) -> dict:
    """A sweep point's tiles, splits as the kernel will run them (its default times factor)."""
    if weights == "int4":
        splits = max(1, round(int4_gemv.default_splits(n, k, tile["block_n"]) * factor))
        return dict(tile, splits=int4_gemv._whole_splits(k // quant_matmul.CHUNK_ROWS, splits))
    default = fp8_gemv.default_splits(n, k, tile["block_n"], tile["block_k"])
    steps = -(-k // tile["block_k"])
    splits = min(steps, max(1, round(default * factor)))
    return dict(tile, splits=-(-steps // -(-steps // splits)))


def default_tiles(weights: str, k: int, n: int) -> dict:
    if weights == "int4":
        return sweep_tiles("int4", k, n, dict(block_n=int4_gemv.DEFAULT_BLOCK_N,
                                              num_warps=int4_gemv.DEFAULT_NUM_WARPS,
                                              num_stages=int4_gemv.DEFAULT_NUM_STAGES), 1)
    block_n, block_k = fp8_gemv.DEFAULT_TILE
    return sweep_tiles("fp8", k, n, dict(block_n=block_n, block_k=block_k, num_warps=4,
                                         num_stages=fp8_gemv.DEFAULT_NUM_STAGES), 1)


def batches(weights: str, where: str, only: dict | None = None) -> list[list[dict]]:
    """The main variants of every projection, then each projection's sweep (the defaults'
    tiles left out: timed in the first batch). only: the dimensions swept and their values,
    the others held at the defaults' (splits: the default's multiples)."""
    main = [dict(kind=kind, proj=proj, tiles={}) for proj in SHAPES[where]
            for kind in MAIN[weights] if kind != "fp8_gemv_norm" or proj in NORMED]
    out = [main]
    sweep = dict(SWEEP[weights, where])
    if only:
        held = default_tiles(weights, *next(iter(SHAPES[where].values())))
        sweep = {key: only.get(key, (1,) if key == "splits" else (held[key],)) for key in sweep}
    factors = sweep.pop("splits")
    points = [dict(zip(sweep, values)) for values in
              itertools.product(*sweep.values())]
    for proj, (k, n) in SHAPES[where].items():
        default = default_tiles(weights, k, n)
        tiles = {tuple(sweep_tiles(weights, k, n, t, f).items()) for t in points for f in factors}
        out.append([dict(kind=SWEPT[weights], proj=proj, tiles=dict(t), sweep=True)
                    for t in sorted(tiles) if dict(t) != default])
    return out


# shapes ragged against the swept kernel's tiles (N past the last tile; FP8: a K split left with
# no step), checked at each num_stages the run sweeps before anything is timed
RAGGED = {"int4": (1024, 200, dict(block_n=128, splits=3)),
          "fp8": (520, 200, dict(block_n=32, block_k=64, splits=4))}


def ragged_rows(weights: str, stages, interpret: bool) -> list[dict]:
    """The swept kernel on RAGGED's shape at each of `stages`, against its reference."""
    k, n, tiles = RAGGED[weights]
    [w] = make_weights(weights, k, n, 1, jax.random.key(k + n))
    x = jax.random.normal(jax.random.key(n), (1, k), jnp.bfloat16)
    rows = []
    for num_stages in stages:
        p = dict(kind=SWEPT[weights], tiles=dict(tiles, num_stages=num_stages),
                 interpret=interpret)
        row = {"kind": p["kind"], "proj": f"ragged {k} -> {n}", **p["tiles"], "ragged": True}
        try:
            row["err"] = checked(p, x, w)
        except Exception as e:  # a failing variant is a row, not the end of the run
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def check(p: dict, x, w) -> float:
    """The variant's error against the reference on the same inputs."""
    got = jax.jit(projection(p, p["interpret"]))(x, w).astype(jnp.float32)
    if p["kind"] == "bf16":
        want = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    elif p["kind"] == "xla_int4":
        q, sc, z = w
        deq = (q.astype(jnp.float32) + 8 - z[:, None].astype(jnp.float32)) * sc[:, None]
        want = jnp.dot(x.astype(jnp.float32), deq.astype(x.dtype).astype(jnp.float32)
                       .reshape(-1, q.shape[2]), precision=jax.lax.Precision.HIGHEST)
    elif p["kind"].startswith("fp8") or p["kind"] == "xla_w8a16":
        norm = dict(norm_weight=w[2], eps=EPS) if p["kind"] == "fp8_gemv_norm" else {}
        want = fp8_gemv.fp8_gemv_reference(x, w[0], w[1], **norm).astype(jnp.float32)
    else:
        want = quant_matmul.int4_matmul_reference(x, *w).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def checked(p: dict, x, w) -> float:
    """check's error, raising past MAX_ERR."""
    err = check(p, x, w)
    if not err <= MAX_ERR:
        raise ValueError(f"error {err:.2e} over {MAX_ERR}")
    return err


def compile_all(programs: list[dict], args_of) -> None:
    """Checks, lowers and compiles every program in threads (XLA's compiler releases the GIL);
    sets each one's "err" and "compiled", or "error"."""
    def build(p):
        x, ws = args_of(p)
        err = checked(p, x, ws[0])
        return err, jax.jit(qlg.chain(projection(p, p["interpret"]))).lower(x, ws).compile()

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        futures = [pool.submit(build, p) for p in programs]
        for p, future in zip(programs, futures):
            try:
                p["err"], p["compiled"] = future.result()
            except Exception as e:  # a failing variant is a row, not the end of the run
                p["error"] = f"{type(e).__name__}: {str(e)[:300]}"


def row(p: dict, weights: str, times: dict, index: int, copy_bps: float, shapes: dict) -> dict:
    k, n = shapes[p["proj"]]
    base = {"kind": p["kind"], "proj": p["proj"], "k": k, "n": n, **p["tiles"],
            "sweep": p.get("sweep", False)}
    if p["kind"] == SWEPT[weights] and not p["tiles"]:
        base.update(defaults=True, **default_tiles(weights, k, n))
    if "error" in p:
        return {**base, "error": p["error"]}
    runs = [times[index, r] for r in range(qlg.RUNS) if (index, r) in times]
    on_gpu = any(t["kernels"] for t in runs)
    if not runs or (on_gpu and min(t["kernels"] for t in runs) < p["calls"]):
        return {**base, "error": f"trace holds {[t['kernels'] for t in runs]} GPU kernels a run "
                                 f"for {p['calls']} calls: timing incomplete"}
    us = statistics.median((t["gpu_us"] if on_gpu else t["wall_us"]) / p["calls"] for t in runs)
    floor = weight_bytes(p["kind"], k, n) / copy_bps * 1e6
    return {**base, "err": p["err"], "us": us, "floor_us": floor, "pct_floor": 100 * floor / us,
            "timer": "gpu kernels" if on_gpu else "wall"}


def tables(rows: list[dict], weights: str, shapes: dict) -> str:
    """us (% of the floor) per projection and the layer's sum: each main variant at its
    defaults, and the swept kernel's best tiling (named below)."""
    timed = [r for r in rows if "us" in r]
    picks = {kind: (lambda r, kind=kind: r["kind"] == kind and not r["sweep"])
             for kind in MAIN[weights]}
    picks[f"{SWEPT[weights]} best"] = lambda r: r["kind"] == SWEPT[weights]
    lines = ["| proj | " + " | ".join(f"{name} us (% floor)" for name in picks) + " |",
             "|" + " --- |" * (1 + len(picks))]
    best, layer = {}, {name: [] for name in picks}
    for proj in shapes:
        cells = []
        for name, pick in picks.items():
            found = [r for r in timed if r["proj"] == proj and pick(r)]
            r = min(found, key=lambda r: r["us"], default=None)
            layer[name].append(r)
            cells.append("-" if r is None else f"{r['us']:.1f} ({r['pct_floor']:.0f}%)")
            if name.endswith("best") and r is not None:
                keys = ("block_n", "block_k", "num_warps", "num_stages", "splits")
                best[f"{name} {proj}"] = {key: r[key] for key in keys if key in r}
        lines.append(f"| {proj} | " + " | ".join(cells) + " |")
    cells = []
    for name, found in layer.items():
        if None in found:  # fp8_gemv_norm: qkv and gate/up only
            cells.append("-")
            continue
        us, floor = sum(r["us"] for r in found), sum(r["floor_us"] for r in found)
        cells.append(f"{us:.1f} ({100 * floor / us:.0f}%)")
    lines.append("| layer | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nbest GEMV tiles: {json.dumps(best)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", choices=("int4", "fp8"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="no sweep batch starts after this many seconds")
    parser.add_argument("--sweep", nargs="+", metavar="NAME=V,V", default=[],
                        help="sweep only these dimensions (e.g. num_stages=1,3 splits=1,0.5), "
                             "the others at the defaults' tiles")
    args = parser.parse_args()
    only = {}
    for item in args.sweep:
        name, _, values = item.partition("=")
        if name not in SWEEP[args.weights, "gpu"] or not values:
            parser.error(f"--sweep {item}: NAME=V,V with NAME one of "
                         f"{', '.join(SWEEP[args.weights, 'gpu'])}")
        only[name] = tuple(float(v) if name == "splits" else int(v) for v in values.split(","))
    os.makedirs(args.out, exist_ok=True)
    where = "cpu" if args.cpu else "gpu"
    interpret = jax.default_backend() != "gpu"
    start = time.perf_counter()
    ceilings = (measure_ceilings("bfloat16", copy_bytes=1 << 20, matmul_n=128, reps=3)
                if args.cpu else measure_ceilings("bfloat16"))
    shapes, weights = SHAPES[where], {}
    for proj, (k, n) in shapes.items():
        for kind in ("bf16", args.weights):
            copies = max(2, math.ceil(WEIGHT_SPAN[where] / weight_bytes(kind, k, n)))
            weights[proj, kind] = make_weights(kind, k, n, copies, jax.random.key(k * 7 + n))
        if args.weights == "int4":
            weights[proj, "xla_int4"] = [xla_int4_weights(*w) for w in weights[proj, "int4"]]
    xs = {k: jax.random.normal(jax.random.key(k), (1, k), jnp.bfloat16) for k, _ in shapes.values()}
    args_of = lambda p: (xs[shapes[p["proj"]][0]],  # noqa: E731
                         weights[p["proj"], p["kind"] if p["kind"] in ("bf16", "xla_int4")
                                 else args.weights])
    stages = only.get("num_stages", SWEEP[args.weights, where]["num_stages"])
    rows = ragged_rows(args.weights, stages, interpret)
    for r in rows:
        print(json.dumps(r), flush=True)
    for index, batch in enumerate(batches(args.weights, where, only)):
        for p in batch:
            p.update(interpret=interpret, calls=len(args_of(p)[1]))
        if index and time.perf_counter() - start > args.budget_s:  # the main batch always runs
            rows += [dict(kind=p["kind"], proj=p["proj"], **p["tiles"],
                          sweep=p.get("sweep", False), skipped=True)
                     for p in batch]
            continue
        compile_all(batch, args_of)
        with tempfile.TemporaryDirectory() as trace_dir:
            qlg.trace_runs(batch, args_of, trace_dir)
            times = qlg.run_times(trace_dir)
        for i, p in enumerate(batch):
            rows.append(row(p, args.weights, times, i, ceilings.hbm_bytes_per_s, shapes))
            print(json.dumps(rows[-1]), flush=True)
    summary = {"device": ceilings.device, "copy_GBps": ceilings.hbm_bytes_per_s / 1e9,
               "weights": args.weights, "tokens": 1, "elapsed_s": time.perf_counter() - start,
               "skipped": sum(1 for r in rows if r.get("skipped")),
               "errors": sum(1 for r in rows if "error" in r)}
    with open(os.path.join(args.out, f"gemv_{args.weights}.json"), "w") as f:
        json.dump({**summary, "rows": rows}, f, indent=1)
    print(f"\n{json.dumps(summary)}\n{tables(rows, args.weights, shapes)}")


if __name__ == "__main__":
    main()
