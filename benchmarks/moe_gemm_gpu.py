"""How fast XLA runs the MoE expert matmul (`jax.lax.ragged_dot`) on this GPU.

Qwen3-30B-A3B's expert up-projection (128 experts, hidden 2048 -> 768, top-8): T tokens routed
uniformly at random give T * 8 rows sorted by expert. Prints the time of the ragged_dot, of a
dense matmul with the same useful FLOPs ([T*8, 2048] x [2048, 768]), and the ragged one's
TFLOP/s. A ragged_dot lowered as a dense dot over every expert would run ~128x slower than the
dense row; cuDNN's grouped GEMM should be within a small factor of it.

    python benchmarks/moe_gemm_gpu.py [--tokens 64 2048 8192]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768


def _time(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def measure(num_tokens: int) -> dict:
    rng = np.random.default_rng(0)
    rows = num_tokens * TOP_K
    experts = rng.integers(0, NUM_EXPERTS, size=rows)
    group_sizes = jnp.asarray(np.bincount(experts, minlength=NUM_EXPERTS), jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.bfloat16)  # [T*k, H], expert-sorted
    w = jnp.asarray(rng.standard_normal((NUM_EXPERTS, HIDDEN, INTERMEDIATE)) * 0.02, jnp.bfloat16)
    ragged = jax.jit(jax.lax.ragged_dot)
    dense = jax.jit(lambda x, w: x @ w)
    ragged_s = _time(ragged, x, w, group_sizes)
    dense_s = _time(dense, x, w[0])
    flops = 2 * rows * HIDDEN * INTERMEDIATE
    return {"tokens": num_tokens, "rows": rows, "ragged_dot_us": round(ragged_s * 1e6, 1),
            "dense_us": round(dense_s * 1e6, 1), "ragged_over_dense": round(ragged_s / dense_s, 2),
            "ragged_tflops": round(flops / ragged_s / 1e12, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 2048, 8192])
    for num_tokens in parser.parse_args().tokens:
        print(json.dumps(measure(num_tokens)), flush=True)


if __name__ == "__main__":
    main()
