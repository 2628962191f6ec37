"""One GPU call, ~1 minute: each Llama-3.1-8B projection alone, per weight kind and token count,
to choose how each kind runs per bucket (the engine's batch-1 FP8 and int4 steps measured far
from their floors: docs/lab/2026-12-01-session9.md).

    python benchmarks/quant_linear_gpu.py --out DIR          # a GPU
    python benchmarks/quant_linear_gpu.py --out DIR --cpu    # tiny shapes, to test the script

Projections (K -> N): qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672,
down 14336 -> 4096. Tokens T: 1, 8, 32, 128, 512, 2048. Kinds:
- bf16: x @ w;
- fp8 W8A8: the engine's `linear` (x quantised per token, one FP8 x FP8 dot, both scales);
- fp8 weight-only: x @ values upcast to bf16 inside the dot's fusion, then the channel scale
  (what XLA makes of it is the question: a convert fused into a Triton GEMM reads 1 byte a
  weight, a separate convert writes and reads 2 more);
- int4: the engine's `linear` on random packed weights, group 128 (the Pallas kernel).
Microseconds per call (`ceilings.time_chain`, weights rotated among copies that exceed L2) and
% of the call's floor (weight + activation bytes over the measured copy bandwidth, or FLOPs over
the matmul rate). DIR gets quant_linear.json; a table prints last.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from jaxllm.models.quant import Int4Weight, linear, quantize_fp8
from pallas_kernels.ceilings import measure_ceilings, time_chain

SHAPES = {"gpu": {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                  "down": (14336, 4096)},
          "cpu": {"qkv": (256, 384), "down": (512, 256)}}
TOKENS = {"gpu": (1, 8, 32, 128, 512, 2048), "cpu": (1, 8)}
COPIES = 4  # weight copies rotated: 4 x the smallest (o, int4: 8 MiB) exceeds the 50 MiB L2


def fp8_weight_only(x, w):
    out_ndim = w.values.ndim - 1
    y = jax.lax.dot_general(x, w.values.astype(x.dtype), (((1,), (out_ndim,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return (y * w.scale).astype(x.dtype)


def weights(kind: str, k: int, n: int, key) -> list:
    """COPIES weights of one kind for a [K, N] projection."""
    out = []
    for i in range(COPIES):
        sub = jax.random.fold_in(key, i)
        w = (0.02 * jax.random.normal(sub, (k, n), jnp.float32)).astype(jnp.bfloat16)
        if kind == "int4":
            w = Int4Weight(jax.random.bits(sub, (k // 8, n), jnp.uint32).view(jnp.int32),
                           jnp.full((k // 128, n), 2e-3, jnp.bfloat16),
                           jnp.full((k // 128, n), 8, jnp.uint8), None, k)
        elif kind.startswith("fp8"):
            w = quantize_fp8(w)
        out.append(w)
    return out


def weight_bytes(kind: str, k: int, n: int) -> float:
    per = {"bf16": 2.0, "fp8 W8A8": 1.0, "fp8 weight-only": 1.0, "int4": 0.5 + 3 / 128}[kind]
    return k * n * per


def measure(kind: str, k: int, n: int, num_tokens: int, ceilings) -> dict:
    ws = weights(kind, k, n, jax.random.key(k * 7 + n))
    fn = fp8_weight_only if kind == "fp8 weight-only" else linear
    x = (jax.random.normal(jax.random.key(1), (num_tokens, k), jnp.float32)).astype(jnp.bfloat16)

    def call(x, i, ws):  # the output's first K columns feed the next call (a chain)
        y = fn(x, ws[i % COPIES])
        return jnp.tile(y, (1, -(-k // n)))[:, :k].astype(x.dtype) if n < k else y[:, :k]

    seconds = time_chain(call, x, ws)
    io_bytes = weight_bytes(kind, k, n) + 2 * num_tokens * (k + n)
    floor = max(io_bytes / ceilings.hbm_bytes_per_s,
                2 * num_tokens * k * n / ceilings.matmul_flops_per_s)
    return {"kind": kind, "k": k, "n": n, "tokens": num_tokens, "us": seconds * 1e6,
            "floor_us": floor * 1e6, "pct_floor": 100 * floor / seconds}


def table(rows: list[dict]) -> str:
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    lines = ["| proj | T | " + " | ".join(f"{k} us (% floor)" for k in kinds) + " |",
             "|" + " --- |" * (2 + len(kinds))]
    for (k, n, t) in dict.fromkeys((r["k"], r["n"], r["tokens"]) for r in rows):
        cells = [next((f"{r['us']:.1f} ({r['pct_floor']:.0f}%)" for r in rows
                       if (r["kind"], r["k"], r["n"], r["tokens"]) == (kind, k, n, t)), "-")
                 for kind in kinds]
        lines.append(f"| {k}x{n} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    where = "cpu" if args.cpu else "gpu"
    ceilings = (measure_ceilings("bfloat16", copy_bytes=1 << 20, matmul_n=128, reps=3)
                if args.cpu else measure_ceilings("bfloat16"))
    rows = []
    for name, (k, n) in SHAPES[where].items():
        for num_tokens in TOKENS[where]:
            for kind in ("bf16", "fp8 W8A8", "fp8 weight-only", "int4"):
                try:
                    rows.append(measure(kind, k, n, num_tokens, ceilings))
                except Exception as e:  # a failing kind is a row, not the end of the run
                    rows.append({"kind": kind, "k": k, "n": n, "tokens": num_tokens,
                                 "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(args.out, "quant_linear.json"), "w") as f:
            json.dump({"device": ceilings.device, "ceilings": ceilings.as_dict(), "rows": rows},
                      f, indent=1)
    print(f"\n{ceilings.device}, copy {ceilings.hbm_bytes_per_s / 1e9:.0f} GB/s")
    print(table([r for r in rows if "us" in r]))


if __name__ == "__main__":
    main()
