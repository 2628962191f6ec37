"""One GPU call, ~4 minutes: the Triton decode kernel on a float8_e4m3fn KV cache against the same
kernel on a bf16 cache, at its default tiles and at others (the engine's 256-sequence decode
step spent 19.5 ms in attention on an FP8 cache and 13.1 ms on bf16: docs/lab/, session 13).

    python benchmarks/experiments/fp8_kv_attention_gpu.py --out DIR [--cpu]

Each FP8 output against the fp32 reference of the same cache; times by `ceilings.time_chain`;
% of the copy bandwidth for the cache bytes read.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from pallas_kernels.bench import HEADS, attn_args, kv_bytes, random_batch, rel_err
from pallas_kernels.ceilings import measure_ceilings, time_chain
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)

FP8 = jnp.float8_e4m3fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    cases = [(8, 64)] if cli.cpu else [(256, 1536), (1, 4096)]
    tilings = [{}] if cli.cpu else [{}] + [
        dict(block_k=bk, num_warps=nw, num_stages=ns)
        for bk, nw, ns in ((32, 4, 3), (32, 2, 4), (64, 4, 4), (64, 2, 3), (64, 8, 3),
                           (128, 4, 3), (128, 8, 3))]
    copy = 1.0 if cli.cpu else measure_ceilings("bfloat16").hbm_bytes_per_s / 1e9
    rows = []
    for seqs, ctx in cases:
        b = random_batch(jax.random.key(0), [1] * seqs, [ctx] * seqs, copies=1 if cli.cpu else 3,
                         **HEADS)
        b8 = dict(b, k_cache=(b["k_cache"] * 0.5).astype(FP8), v_cache=b["v_cache"].astype(FP8))
        ref = ragged_paged_attention_reference(*attn_args(b8), sm_scale=0.088, k_scale=2.0)
        for cache in ("bf16", "fp8"):
            batch = b if cache == "bf16" else b8
            for tiles in tilings:
                # the batch goes in as an argument: closed over, XLA would embed it as constants
                def call(q, i, batch, cache=cache, tiles=tiles):
                    args = attn_args(batch, i % batch["block_tables"].shape[0])
                    return ragged_paged_attention(
                        q, *args[1:], sm_scale=0.088, interpret=cli.cpu, implementation="triton",
                        k_scale=1.0 if cache == "bf16" else 2.0, **tiles)
                row = dict(seqs=seqs, ctx=ctx, cache=cache, **tiles)
                try:
                    out = jax.jit(call, static_argnums=1)(b["q"], 0, batch)
                    if cache == "fp8":
                        row["rel_err"] = rel_err(out, ref)
                    secs = time_chain(call, b["q"], batch, reps=3)
                    nbytes = kv_bytes([ctx] * seqs, HEADS, 2 if cache == "bf16" else 1)
                    row.update(us=secs * 1e6, pct_bw=100 * nbytes / secs / 1e9 / copy)
                except Exception as e:  # noqa: BLE001 (a failing variant is a row)
                    row["error"] = repr(e)[-400:]
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(os.path.join(cli.out, "fp8_kv_attention.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
