"""One GPU call, ~4 minutes: the Triton kernel on a float8_e4m3fn KV cache against the same
kernel on a bf16 cache, with V read as float8 or as int16 pairs (the kernel's v_pairs), at its
default tiles and at others (the engine's 256-sequence decode step spent 19.5 ms in attention
on an FP8 cache and 13.1 ms on bf16: docs/lab/, session 13).

    python benchmarks/experiments/fp8_kv_attention_gpu.py --out DIR [--cpu] [--case mixed]

Cases: decode, 512 sequences x 1536 tokens and 8 x 8192 (KV splits); a mixed prefill bucket
(511 decodes at 1536 and a 1536-token prompt, 2048 tokens; on the GPU also through the entry's
Mosaic path: bf16 pages, and float8 pages with the prompt's pages staged in 16 bits); and the
512 x 1536 decode's bytes as 4,096 sequences of one KV head (4 q heads) each: a program then
reads its pages as contiguous runs (16 tokens x 128 dims, 2 KB in float8) where the cache's
[page, token, head, dim] layout gives it 128-byte pieces 1 KB apart, the locality of a
head-major page layout (TensorRT-LLM's) without changing the kernel. Each FP8 output against
the fp32 reference of the same cache; times by `ceilings.time_chain`; % of the copy bandwidth
for the cache bytes read.
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
from pallas_kernels.ragged_paged_attention import (_triton_attention, ragged_paged_attention,
                                                   ragged_paged_attention_reference)

FP8 = jnp.float8_e4m3fn


def variants(case: str, cpu: bool) -> list[tuple[str, dict]]:
    """(cache dtype, _triton_attention's keywords): each cache at its default, float8 pages also
    at other tiles (block_k, warps, stages); on the mixed bucket the decodes at the prefill
    tiling (one launch) or apart (the entry's default, and at 64-token tiles)."""
    if case.startswith("mixed"):
        mosaic = [] if cpu else [("bf16", dict(only="entry")), ("fp8", dict(only="mosaic"))]
        return [("fp8", dict(only=None)), ("fp8", dict(only="split")),
                ("fp8", dict(only="split", decode_block_k=64)), *mosaic]
    if cpu:
        return [("bf16", {}), ("fp8", {})]
    if case.startswith("decode 8") or "one KV head" in case:  # KV splits; the locality probe
        return [("bf16", {}), ("fp8", {}), ("fp8", dict(block_k=64))]
    return [("bf16", {}), ("fp8", {}), ("fp8", dict(block_k=64)), ("fp8", dict(block_k=256)),
            ("fp8", dict(num_stages=3))]


def attention(q, args, cache, cpu, kw):
    """One launch, or (only="split") the entry's two: decodes, then the rest; or the entry
    itself (only="entry": on bf16 pages on Hopper, the Mosaic kernel) or its Mosaic path
    (only="mosaic": on float8 pages, the prefill's pages staged in 16 bits)."""
    kw = dict(kw, sm_scale=0.088, interpret=cpu, k_scale=1.0 if cache == "bf16" else 2.0)
    only = kw.pop("only", None)
    if only in ("entry", "mosaic"):
        return ragged_paged_attention(q, *args[1:], **kw,
                                      implementation="mosaic" if only == "mosaic" else None)
    if only == "split":
        if "decode_block_k" not in kw:
            return ragged_paged_attention(q, *args[1:], **kw)
        decodes = _triton_attention(q, *args[1:], only="decode", block_k=kw.pop("decode_block_k"),
                                    **kw)
        return _triton_attention(q, *args[1:], only="prefill", out=decodes, **kw)
    return _triton_attention(q, *args[1:], **kw)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--case", default="", help="only the cases whose name starts so")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    one_head = dict(HEADS, num_q_heads=HEADS["num_q_heads"] // HEADS["num_kv_heads"],
                    num_kv_heads=1)
    cases = {"cpu decode": ([1] * 8, [64] * 8, HEADS),
             "mixed cpu": ([1] * 8 + [24], [64] * 9, HEADS),
             "cpu decode, one KV head a sequence": ([1] * 16, [64] * 16, one_head),
             } if cli.cpu else {
        "decode 512x1536": ([1] * 512, [1536] * 512, HEADS),
        "decode 4096x1536, one KV head a sequence": ([1] * 4096, [1536] * 4096, one_head),
        "decode 8x8192": ([1] * 8, [8192] * 8, HEADS),
        "mixed 511 decodes + 1536 new": ([1] * 511 + [1536], [1536] * 511 + [1536], HEADS)}
    copy = 1.0 if cli.cpu else measure_ceilings("bfloat16").hbm_bytes_per_s / 1e9
    rows = []
    for case, (q_lens, kv_lens, heads) in cases.items():
        if not case.startswith(cli.case):
            continue
        # two copies at most: a float8 cache stays under the 2 GiB the kernel can address
        b = random_batch(jax.random.key(0), q_lens, kv_lens, copies=1 if cli.cpu else 2,
                         num_tokens=_bucket(sum(q_lens)), max_seqs=len(q_lens), **heads)
        b8 = dict(b, k_cache=(b["k_cache"] * 0.5).astype(FP8), v_cache=b["v_cache"].astype(FP8))
        batches = {"bf16": b, "fp8": b8}
        refs = {"fp8": ragged_paged_attention_reference(*attn_args(b8), sm_scale=0.088,
                                                        k_scale=2.0),
                "bf16": ragged_paged_attention_reference(*attn_args(b), sm_scale=0.088)}
        for cache, kw in variants(case, cli.cpu):
            batch = batches[cache]

            # the batch goes in as an argument: closed over, XLA would embed it as constants
            def call(q, i, batch, cache=cache, kw=kw):
                return attention(q, attn_args(batch, i % batch["block_tables"].shape[0]),
                                 cache, cli.cpu, kw)

            def check(call=call, batch=batch, cache=cache):
                out = jax.jit(call, static_argnums=1)(batch["q"], 0, batch)
                live = sum(q_lens)
                return ({"rel_err": rel_err(out[:live], refs[cache][:live])}
                        if cache in refs else {})
            row = timed_variant(dict(case=case, cache=cache, **kw), check, call, batch["q"], batch,
                                nbytes=kv_bytes(kv_lens, heads, 2 if cache == "bf16" else 1),
                                copy_GBps=copy)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(os.path.join(cli.out, "fp8_kv_attention.json"), "w") as f:
        json.dump(rows, f, indent=1)


def _bucket(num_tokens: int) -> int:
    """The engine's token bucket: a power of two."""
    return 1 << (num_tokens - 1).bit_length()


if __name__ == "__main__":
    main()
