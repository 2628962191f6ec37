"""What the BERT MLP's exact (erf) GELU costs on the GPU, and what other spellings of the same
function cost: the BERT-base shape at batch 256 x 512 tokens, fp16, one layer's intermediate
projection, bias and GELU, with the output projection after it (so that XLA fuses as in the
model). GPU kernel time per call from a profiler trace, each kernel named.

    python benchmarks/experiments/gelu_gpu.py --out DIR      # one GPU, well under a minute

Variants: jax.nn.gelu (exact, what models/bert.py runs); the same erf formula written in fp32 by
hand; 0.5 x erfc(-x / sqrt 2); and the tanh approximation (not BERT's function: the bound).
Each variant's largest difference from the fp32 exact GELU is printed beside its time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

# before jax starts: every kernel launched on its own, so the profiler traces each one
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from profile_decode import gpu_stream_events, read_trace  # noqa: E402

SQRT_HALF = 0.7071067811865476
VARIANTS = {
    "jax.nn.gelu exact": lambda h: jax.nn.gelu(h, approximate=False),
    "erf in fp32": lambda h: (lambda x: x * 0.5 * (1 + jax.lax.erf(x * SQRT_HALF)))(
        h.astype(jnp.float32)).astype(h.dtype),
    "erfc in fp32": lambda h: (lambda x: x * 0.5 * jax.lax.erfc(-x * SQRT_HALF))(
        h.astype(jnp.float32)).astype(h.dtype),
    "tanh approximation": lambda h: jax.nn.gelu(h, approximate=True),
}


def gpu_kernels_us(trace_dir: str) -> dict[str, float]:
    """Kernel name -> total us on the GPU's streams in the trace."""
    _, events, process = read_trace(trace_dir, "perfetto_trace.json.gz")
    on_stream = gpu_stream_events(events, process)
    totals = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and on_stream(e):
            totals[e["name"][:60]] += e["dur"]
    return totals


def mlp(gelu, x, w_in, b_in, w_out):
    return jnp.einsum("ti,ih->th", gelu(jnp.einsum("th,hi->ti", x, w_in) + b_in), w_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=256 * 512)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (args.tokens, 768), jnp.float16)
    w_in = (0.03 * jax.random.normal(keys[1], (768, 3072))).astype(jnp.float16)
    b_in = (0.1 * jax.random.normal(keys[2], (3072,))).astype(jnp.float16)
    w_out = (0.02 * jax.random.normal(keys[3], (3072, 768))).astype(jnp.float16)
    probe = jnp.linspace(-8, 8, 65536, dtype=jnp.float32)
    exact = jax.nn.gelu(probe, approximate=False)
    results = {}
    for name, gelu in VARIANTS.items():
        error = float(jnp.max(jnp.abs(gelu(probe.astype(jnp.float16)).astype(jnp.float32)
                                      - exact)))
        fn = jax.jit(lambda x, f=gelu: mlp(f, x, w_in, b_in, w_out))
        jax.block_until_ready(fn(x))
        trace_dir = os.path.join(args.out, name.replace(" ", "_").replace(".", "_"))
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.calls):
                out = fn(x)
            jax.block_until_ready(out)
        kernels = gpu_kernels_us(trace_dir)
        total = sum(kernels.values()) / args.calls
        results[name] = {"max_abs_error_vs_fp32_exact": error, "gpu_us_per_call": total,
                         "kernels_us": {k: v / args.calls for k, v in sorted(
                             kernels.items(), key=lambda kv: -kv[1])[:6]}}
        print(f"{name:20s} {total:9.1f} us per call, max |error| {error:.2e}: "
              + ", ".join(f"{k} {v:.0f}" for k, v in results[name]["kernels_us"].items()),
              flush=True)
    with open(os.path.join(args.out, "gelu_gpu.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
