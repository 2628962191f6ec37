"""One GPU call, ~1 minute: the activations' FP8 quantisation kernel (pallas_kernels/fp8_quant.py)
against what XLA makes of the same work (jaxllm's jnp path: the input RMSNorm, then
quantize_fp8_rows), with and without the norm, at an 8B model's H = 4,096 and prefill to decode
token counts, with a few tile choices; each kernel output checked against the reference.

    python benchmarks/experiments/fp8_quant_gpu.py --out DIR [--cpu]

Times by `ceilings.time_chain`; % of copy bandwidth for the bytes read and written once.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp

from jaxllm.models.quant import quantize_fp8_rows, rms_norm
from pallas_kernels.bench import fp8_rows_variant, token_sweep_cli
from pallas_kernels.fp8_quant import fp8_quant, fp8_quant_reference

TILES = [dict(block_rows=r, num_warps=w) for r, w in ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8))]
EPS = 1e-5


def xla_path(x, weight):
    """The jnp path (what the product runs off the GPU, and ran on it before the kernel)."""
    q, s = quantize_fp8_rows(x if weight is None else rms_norm(x, weight, EPS))
    return q, s[:, 0]


def main() -> None:
    cli, token_counts, copy = token_sweep_cli((2, 8), (16, 64, 256, 512, 2048))
    hidden = 256 if cli.cpu else 4096
    sweep_at = () if cli.cpu else (512, 2048)
    rows = []
    for tokens in token_counts:
        k = jax.random.split(jax.random.key(tokens), 2)
        x = (jax.random.normal(k[0], (tokens, hidden)) * 3).astype(jnp.bfloat16)
        weight = jax.random.uniform(k[1], (hidden,), minval=0.3, maxval=2).astype(jnp.bfloat16)
        for norm in (True, False):
            w = weight if norm else None
            want_q, want_s = jax.jit(fp8_quant_reference, static_argnums=2)(x, w, EPS)
            variants = [("xla", None), ("kernel", {})]
            variants += [("kernel", t) for t in TILES] if tokens in sweep_at else []
            for name, tiles in variants:
                fn = xla_path if name == "xla" else functools.partial(
                    fp8_quant, eps=EPS, interpret=cli.cpu, **tiles)
                row = fp8_rows_variant(
                    dict(tokens=tokens, hidden=hidden, norm=norm, path=name, **(tiles or {})),
                    fn, (x, w), (want_q, want_s), copy_GBps=copy,
                    nbytes=tokens * hidden * (2 + 1) + tokens * 4 + (2 * hidden if norm else 0))
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(os.path.join(cli.out, "fp8_quant.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
