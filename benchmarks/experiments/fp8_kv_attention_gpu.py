"""One GPU call, ~5 minutes: the Triton kernel on a float8_e4m3fn KV cache against the same
kernel on a bf16 cache, with V read as float8 or as int16 pairs (the kernel's v_pairs), at its
default tiles and at others (the engine's 256-sequence decode step spent 19.5 ms in attention
on an FP8 cache and 13.1 ms on bf16: docs/lab/, session 13).

    python benchmarks/experiments/fp8_kv_attention_gpu.py --out DIR [--cpu]

Cases: decode, 256 sequences x 1536 tokens and 1 x 4096; prefill, 8 sequences x 512 new tokens
at 1536. Each FP8 output against the fp32 reference of the same cache; times by
`ceilings.time_chain`; % of the copy bandwidth for the cache bytes read.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from pallas_kernels.bench import (HEADS, attn_args, kv_bytes, random_batch, rel_err,
                                  timed_variant)
from pallas_kernels.ceilings import measure_ceilings
from pallas_kernels.ragged_paged_attention import (_triton_attention,
                                                   ragged_paged_attention_reference)

FP8 = jnp.float8_e4m3fn


def variants(case: str, cpu: bool) -> list[tuple[str, dict]]:
    """(cache dtype, _triton_attention's keywords): each cache at its default, FP8 with V read
    either way, and on the 256-sequence decode more tiles."""
    out = [("bf16", {}), ("fp8", {}), ("fp8", dict(v_pairs=True)), ("fp8", dict(v_pairs=False))]
    if case == "decode 256x1536" and not cpu:
        tiles = lambda bk, nw, ns: dict(block_k=bk, num_warps=nw, num_stages=ns)
        out += [("bf16", tiles(64, 4, 3))] + [
            ("fp8", tiles(*t)) for t in ((64, 4, 4), (64, 4, 2), (64, 8, 3), (64, 2, 3),
                                         (128, 4, 3), (128, 8, 3), (32, 4, 3))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    cases = {"cpu decode": ([1] * 8, [64] * 8)} if cli.cpu else {
        "decode 256x1536": ([1] * 256, [1536] * 256), "decode 1x4096": ([1], [4096]),
        "prefill 8x512@1536": ([512] * 8, [1536] * 8)}
    copy = 1.0 if cli.cpu else measure_ceilings("bfloat16").hbm_bytes_per_s / 1e9
    rows = []
    for case, (q_lens, kv_lens) in cases.items():
        b = random_batch(jax.random.key(0), q_lens, kv_lens, copies=1 if cli.cpu else 3, **HEADS)
        b8 = dict(b, k_cache=(b["k_cache"] * 0.5).astype(FP8), v_cache=b["v_cache"].astype(FP8))
        ref = ragged_paged_attention_reference(*attn_args(b8), sm_scale=0.088, k_scale=2.0)
        for cache, kw in variants(case, cli.cpu):
            batch = b if cache == "bf16" else b8

            # the batch goes in as an argument: closed over, XLA would embed it as constants
            def call(q, i, batch, cache=cache, kw=kw):
                args = attn_args(batch, i % batch["block_tables"].shape[0])
                return _triton_attention(q, *args[1:], sm_scale=0.088, interpret=cli.cpu,
                                         k_scale=1.0 if cache == "bf16" else 2.0, **kw)
            def check(call=call, batch=batch, cache=cache):
                out = jax.jit(call, static_argnums=1)(b["q"], 0, batch)
                live = sum(q_lens)
                return {"rel_err": rel_err(out[:live], ref[:live])} if cache == "fp8" else {}
            row = timed_variant(dict(case=case, cache=cache, **kw), check, call, b["q"], batch,
                                nbytes=kv_bytes(kv_lens, HEADS, 2 if cache == "bf16" else 1),
                                copy_GBps=copy)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(cli.out, "fp8_kv_attention.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
