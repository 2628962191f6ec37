"""One GPU call, ~2 minutes: the SwiGLU quantisation kernel (pallas_kernels/silu_mul_fp8.py)
against what XLA made of the same step before it (the gate/up product scaled to bf16, silu(gate)
* up, then quantize_fp8_rows: two fusions), at an 8B model's I = 14,336 and decode to prefill
token counts, with a few tile choices; each kernel output checked against the reference.

    python benchmarks/experiments/silu_mul_fp8_gpu.py --out DIR [--cpu]

Times by `ceilings.time_chain`; % of copy bandwidth for the bytes read and written once. The
chain reads this kernel well above its Nsight Compute time (docs/lab, session 37): rank tilings
with ncu_kernels.py's swiglu cases.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp

from jaxllm.models.quant import quantize_fp8_rows
from pallas_kernels.bench import fp8_rows_variant, token_sweep_cli
from pallas_kernels.silu_mul_fp8 import silu_mul_fp8, silu_mul_fp8_reference

TILES = [dict(block_rows=r, block_cols=c, num_warps=w, row_blocks=b) for r, c, w, b in (
    (1, 1024, 4, 1), (1, 2048, 8, 1), (4, 1024, 4, 1), (16, 256, 4, 1),
    (1, 2048, 4, 4), (1, 2048, 4, 8), (4, 512, 4, 4), (8, 256, 4, 4), (8, 256, 4, 8),
    (1, 16384, 8, 1), (1, 16384, 16, 2))]  # the last two: one read


def xla_path(y, x_scale, w_scale):
    """The FP8 MLP's step between its GEMMs before the kernel (quant.py at 468faf5)."""
    gate_up = (y.astype(jnp.float32) * x_scale[:, None] * w_scale[None, :]).astype(jnp.bfloat16)
    g, u = jnp.split(gate_up, 2, axis=1)
    q, s = quantize_fp8_rows(jax.nn.silu(g) * u)
    return q, s[:, 0]


def swiglu_inputs(tokens: int, width: int):
    """The gate/up GEMM's unscaled bf16 product y [T, 2I], its token scales [T] and channel
    scales [2I]."""
    k = jax.random.split(jax.random.key(tokens), 3)
    y = (jax.random.normal(k[0], (tokens, 2 * width)) * 300).astype(jnp.bfloat16)
    x_scale = jax.random.uniform(k[1], (tokens,), minval=1e-4, maxval=1e-2)
    w_scale = jax.random.uniform(k[2], (2 * width,), minval=1e-4, maxval=1e-2)
    return y, x_scale, w_scale


def main() -> None:
    cli, token_counts, copy = token_sweep_cli((1, 8), (1, 64, 256, 512, 2048))
    width = 256 if cli.cpu else 14336
    sweep_at = () if cli.cpu else (256, 512, 2048)
    rows = []
    for tokens in token_counts:
        y, x_scale, w_scale = swiglu_inputs(tokens, width)
        want_q, want_s = jax.jit(silu_mul_fp8_reference)(y, x_scale, w_scale)
        variants = [("xla", None), ("kernel", {})]
        variants += [("kernel", t) for t in TILES] if tokens in sweep_at else []
        for name, tiles in variants:
            fn = xla_path if name == "xla" else functools.partial(
                silu_mul_fp8, interpret=cli.cpu, **tiles)
            row = fp8_rows_variant(
                dict(tokens=tokens, width=width, path=name, **(tiles or {})), fn,
                (y, x_scale, w_scale), (want_q, want_s), copy_GBps=copy,
                nbytes=tokens * width * (2 * 2 + 1) + 2 * width * 4 + tokens * 8)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(cli.out, "silu_mul_fp8.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
