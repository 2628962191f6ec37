"""How fast XLA runs the MoE expert matmul (`jax.lax.ragged_dot`) on this GPU.

Qwen3-30B-A3B's expert up-projection (128 experts, hidden 2048 -> 768, top-8): T tokens routed
uniformly at random give T * 8 rows sorted by expert. Times, per T: XLA's ragged_dot as jax
lowers it, the same with XLA's cuDNN ragged-dot fusion asked for
(xla_gpu_experimental_use_ragged_dot_fusion), the Pallas kernel (pallas_kernels.grouped_matmul)
at its defaults and over a few tile shapes, and a dense matmul with the same useful FLOPs
([T*8, 2048] x [2048, 768]). A ragged_dot lowered as a dense dot over every expert runs ~128x
slower than the dense row. Then the experts' gate and up projections together: two
grouped_matmul calls and silu(gate) * up, against the fused `grouped_swiglu` pass. Each line
also gives TFLOP/s, the weight-read GB/s (decode is bound by reading the experts) and the
kernel's largest relative error against ragged_dot (gate/up: fused against separate).

    python benchmarks/moe_gemm_gpu.py [--tokens 64 2048 8192] [--sweep]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ceilings import time_calls
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_swiglu

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768


SWEEP = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
         for bn in (64, 128) for bk in (64, 128) for nw in (4, 8) for ns in (2, 3)]
SWEEP += [dict(block_m=32), dict(block_m=128, num_warps=8)]
SWIGLU_SWEEP = [dict(block_n=bn, num_warps=nw) for bn in (64, 128) for nw in (4, 8)]


def _compiled(fn, *args, **compiler_options):
    return jax.jit(fn).lower(*args).compile(compiler_options=compiler_options or None)


def measure(num_tokens: int, sweep: bool) -> dict:
    rng = np.random.default_rng(0)
    rows = num_tokens * TOP_K
    experts = rng.integers(0, NUM_EXPERTS, size=rows)
    group_sizes = jnp.asarray(np.bincount(experts, minlength=NUM_EXPERTS), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.bfloat16)  # [T*k, H], expert-sorted
    w = jnp.asarray(rng.standard_normal((NUM_EXPERTS, HIDDEN, INTERMEDIATE)) * 0.02, jnp.bfloat16)
    flops = 2 * rows * HIDDEN * INTERMEDIATE
    touched = int(jnp.sum(group_sizes > 0)) * HIDDEN * INTERMEDIATE * 2  # expert bytes read
    want = np.asarray(jax.jit(jax.lax.ragged_dot)(x, w, group_sizes), np.float32)
    result = {"tokens": num_tokens, "rows": rows}

    def record(name, fn, *args, num_weights=1):
        seconds = time_calls(fn, *args)
        result[name] = {"us": round(seconds * 1e6, 1),
                        "tflops": round(num_weights * flops / seconds / 1e12, 1),
                        "weight_gb_s": round(num_weights * touched / seconds / 1e9)}
        return fn

    def max_rel_err(got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

    record("ragged_dot", jax.jit(jax.lax.ragged_dot), x, w, group_sizes)
    try:
        record("ragged_dot_cudnn", _compiled(jax.lax.ragged_dot, x, w, group_sizes,
               xla_gpu_experimental_use_ragged_dot_fusion=True), x, w, group_sizes)
    except Exception as e:  # the flag or cuDNN's support may be missing
        result["ragged_dot_cudnn"] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    for tiles in [{}] + (SWEEP if sweep else []):
        name = "pallas" + "".join(f"_{k}{v}" for k, v in tiles.items())
        fn = jax.jit(lambda x, w, s, tiles=tiles: grouped_matmul(x, w, s, **tiles))
        try:
            record(name, fn, x, w, group_sizes)
        except Exception as e:  # a tile shape Triton cannot fit
            result[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            continue
        result[name]["max_rel_err"] = max_rel_err(fn(x, w, group_sizes), want)
    record("dense", jax.jit(lambda x, w: x @ w), x, w[0])

    w_up = jnp.asarray(rng.standard_normal(w.shape) * 0.02, jnp.bfloat16)
    separate = jax.jit(lambda x, wg, wu, s: (
        jax.nn.silu(grouped_matmul(x, wg, s).astype(jnp.float32))
        * grouped_matmul(x, wu, s).astype(jnp.float32)).astype(x.dtype))
    record("gate_up_separate", separate, x, w, w_up, group_sizes, num_weights=2)
    want = separate(x, w, w_up, group_sizes)
    for tiles in [{}] + (SWIGLU_SWEEP if sweep else []):
        name = "gate_up_fused" + "".join(f"_{k}{v}" for k, v in tiles.items())
        fn = jax.jit(lambda x, wg, wu, s, tiles=tiles: grouped_swiglu(x, wg, wu, s, **tiles))
        try:
            record(name, fn, x, w, w_up, group_sizes, num_weights=2)
        except Exception as e:  # a tile shape Triton cannot fit
            result[name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            continue
        result[name]["max_rel_err"] = max_rel_err(fn(x, w, w_up, group_sizes), want)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 2048, 8192])
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP tile shapes")
    opts = parser.parse_args()
    for num_tokens in opts.tokens:
        print(json.dumps(measure(num_tokens, opts.sweep)), flush=True)


if __name__ == "__main__":
    main()
