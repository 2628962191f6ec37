"""One GPU call, under 4 minutes: the W8A16 FP8 GEMV (pallas_kernels/fp8_gemv.py) against the
bf16 XLA dot and today's W8A8 path (quant._fp8_w8a8: x quantised per token, cuBLAS's FP8 dot,
both scales), on Llama-3.1-8B's four projections at 1 to 16 tokens (1: the one-token bucket
FP8 engines get, so batch-1 decode; 16: the next bucket), with a sweep of the kernel's tilings
at one token, and the half2 candidate (experiments/fp8_gemv_half2.py) at its defaults; every
output checked against the reference before it is timed. bf16 is timed at 1 and 16 tokens only
(a weight read at any of these token counts).

    python benchmarks/experiments/fp8_gemv_gpu.py --out DIR [--cpu] [--budget-s 190]

Projections (K -> N): qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672 (as stored,
[2, 14336, 4096]), down 14336 -> 4096. Times by `ceilings.time_chain`, each call on the next of
several weight copies (together over 256 MiB, so every call reads its weights from HBM, not L2);
pct_bw: % of the FP8 weight-read floor (the fp8 bytes over the measured copy bandwidth) for
every path, bf16 included. err: the largest over rows of max |out - ref| / max |ref|, against
the GEMV's fp32 reference for the FP8 paths (W8A8's includes x's float8 rounding) and the fp32
product for bf16. Work runs most telling first (one token, then 16, the one-token sweep, 2 and
8); what would start past --budget-s is left out as a `skipped` row. DIR gets
fp8_gemv.json; a table of us per layer (the projections summed) prints last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

from jaxllm.models import quant
from pallas_kernels.bench import timed_variant
from pallas_kernels.ceilings import measure_ceilings
from pallas_kernels.fp8_gemv import fp8_gemv, fp8_gemv_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp8_gemv_half2 import fp8_gemv_half2  # noqa: E402

SHAPES = {"gpu": {"qkv": (4096, (6144,)), "o": (4096, (4096,)),
                  "gate_up": (4096, (2, 14336)), "down": (14336, (4096,))},
          "cpu": {"qkv": (256, (384,)), "gate_up": (320, (2, 96))}}
# (tokens, whether bf16 is timed, the GEMV's variants beside W8A8 and its defaults), the most
# telling first: one token (its bucket), the smallest bucket past it, tilings at one token
PLAN = {"gpu": [(1, True, []), (16, True, []),
                (1, False, [dict(block_n=16, block_k=512), dict(block_n=64, num_warps=8),
                            dict(block_n=32, block_k=512, num_warps=8),
                            dict(block_n=64, block_k=128), dict(splits=8)]),
                (2, False, []), (8, False, [])],
        "cpu": [(1, True, []), (3, True, [dict(block_n=32, block_k=64)]),
                (1, False, [dict(block_n=16, block_k=64, splits=3)])]}
ROTATE_BYTES = {"gpu": 256 << 20, "cpu": 0}


def make_weights(k: int, out: tuple, copies: int, key) -> tuple[list, list]:
    """`copies` random [K, *out] weights: bf16, and the same quantised (quant.Fp8Weight)."""
    bf16, fp8 = [], []
    for i in range(copies):
        w = (0.02 * jax.random.normal(jax.random.fold_in(key, i), (k, *out))).astype(jnp.bfloat16)
        bf16.append(w)
        fp8.append(quant.quantize_fp8(w))
    return bf16, fp8


def gemv_path(tiles: dict, interpret: bool, kernel=fp8_gemv):
    """fn(x, w_bf16, w_fp8) -> [T, *out]: the kernel on w_fp8's output axes flattened."""
    def fn(x, _, w):
        flat = kernel(x, w.values.reshape(-1, w.values.shape[-1]), w.scale.reshape(-1),
                      interpret=interpret, **tiles)
        return flat.reshape(x.shape[0], *w.values.shape[:-1])
    return fn


def row_err(got, want) -> float:
    got, want = got.reshape(got.shape[0], -1), want.reshape(want.shape[0], -1)
    err = jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)), axis=1)
    return float(jnp.max(err / jnp.max(jnp.abs(want.astype(jnp.float32)), axis=1)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--budget-s", type=float, default=190.0,
                        help="no variant starts after this many seconds")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    where = "cpu" if cli.cpu else "gpu"
    start = time.perf_counter()
    copy = 1.0 if cli.cpu else measure_ceilings("bfloat16").hbm_bytes_per_s / 1e9
    log = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_GBps": copy,
           "rows": []}
    weights = {}  # proj -> (bf16 copies, fp8 copies)
    for proj, (k, out) in SHAPES[where].items():
        copies = min(11, max(1, -(-ROTATE_BYTES[where] // (k * math.prod(out)))))
        weights[proj] = make_weights(k, out, copies, jax.random.key(len(weights)))
    seen = set()  # (tokens, proj): bf16, W8A8 and the GEMV's defaults timed once a pair
    for tokens, with_bf16, tiles_list in PLAN[where]:
        for proj, (k, out) in SHAPES[where].items():
            n = math.prod(out)
            bf16, fp8 = weights[proj]
            x = jax.random.normal(jax.random.key(tokens), (tokens, k)).astype(jnp.bfloat16)
            want_fp8 = fp8_gemv_reference(x, fp8[0].values.reshape(n, k), fp8[0].scale.reshape(n))
            want = {"fp8": want_fp8.reshape(tokens, *out),
                    "bf16": jnp.einsum("tk,k...->t...", x.astype(jnp.float32),
                                       bf16[0].astype(jnp.float32),
                                       precision=jax.lax.Precision.HIGHEST)}
            variants = [] if (tokens, proj) in seen else [
                ("bf16", None, lambda x, w, _: jnp.tensordot(x, w, axes=1)),
                ("w8a8", None, lambda x, _, w: quant._fp8_w8a8(x, w)),
                ("gemv", {}, gemv_path({}, cli.cpu)),
                ("half2", {}, gemv_path({}, cli.cpu, fp8_gemv_half2))][0 if with_bf16 else 1:]
            seen.add((tokens, proj))
            variants += [("gemv", tiles, gemv_path(tiles, cli.cpu)) for tiles in tiles_list]
            for name, tiles, fn in variants:
                row = dict(tokens=tokens, proj=proj, k=k, n=n, path=name, **(tiles or {}),
                           floor_us=k * n / copy / 1e3)
                if tiles == {}:  # the kernel's defaults
                    row.update(defaults=True)
                if time.perf_counter() - start > cli.budget_s:
                    log["rows"].append(dict(row, skipped=True))
                    continue

                def call(x, i, bf16, fp8, fn=fn):
                    y = fn(x, bf16[i % len(bf16)], fp8[i % len(fp8)])
                    # the next call's input depends on this one's output (a barrier over
                    # (x, y) alone lets XLA drop y)
                    return x.at[0, 0].add((y.reshape(-1)[0] * 0).astype(x.dtype))

                def check(fn=fn, name=name):
                    got = jax.jit(fn)(x, bf16[0], fp8[0])
                    err = row_err(got, want["bf16" if name == "bf16" else "fp8"])
                    # the GEMV: the reference to bf16 rounding (W8A8 is off by x's float8's)
                    return dict(err=err, **({"ok": err < 1e-2} if name in ("gemv", "half2")
                                            else {}))
                row = timed_variant(row, check, call, x, bf16, fp8, nbytes=k * n,
                                    copy_GBps=copy)
                print(json.dumps(row), flush=True)
                log["rows"].append(row)
                with open(os.path.join(cli.out, "fp8_gemv.json"), "w") as f:
                    json.dump(log, f, indent=1)
    log["elapsed_s"] = time.perf_counter() - start
    with open(os.path.join(cli.out, "fp8_gemv.json"), "w") as f:
        json.dump(log, f, indent=1)
    print_table(log)


def print_table(log: dict) -> None:
    """us per layer (the projections summed) per tokens and path: bf16, W8A8, the GEMV at its
    defaults, and the best of its tilings per projection."""
    rows = [r for r in log["rows"] if "us" in r and r["us"] == r["us"]]
    print(f"\n{log['device']}  copy {log['copy_GBps']:.0f} GB/s  elapsed "
          f"{log['elapsed_s']:.0f} s  skipped {sum(1 for r in log['rows'] if r.get('skipped'))}"
          f"  errors {sum(1 for r in log['rows'] if 'error' in r)}")
    tile_keys = ("defaults", "block_n", "block_k", "num_warps", "num_stages", "splits")
    for tokens in sorted({r["tokens"] for r in rows}):
        at = [r for r in rows if r["tokens"] == tokens]
        projs = sorted({r["proj"] for r in at})
        floor = sum(next(r["floor_us"] for r in at if r["proj"] == p) for p in projs)
        cells = []
        for label, pick in (("bf16", lambda r: r["path"] == "bf16"),
                            ("w8a8", lambda r: r["path"] == "w8a8"),
                            ("gemv", lambda r: r["path"] == "gemv" and r.get("defaults")),
                            ("gemv best", lambda r: r["path"] == "gemv"),
                            ("half2", lambda r: r["path"] == "half2")):
            per_proj = [min((r["us"] for r in at if r["proj"] == p and pick(r)), default=None)
                        for p in projs]
            if None not in per_proj:
                cells.append(f"{label} {sum(per_proj):.1f}")
        print(f"tokens {tokens:>2} ({len(projs)} projections): floor {floor:.1f} us | "
              + " | ".join(cells))
        for p in projs:
            gemvs = [r for r in at if r["proj"] == p and r["path"] == "gemv"]
            if gemvs:
                best = min(gemvs, key=lambda r: r["us"])
                print(f"   {p:<8} best gemv {best['us']:.1f} us ({best['pct_bw']:.0f}% of floor, "
                      f"err {best['err']:.1e}) "
                      f"{ {key: best[key] for key in tile_keys if key in best} }")


if __name__ == "__main__":
    main()
