"""What causal prefill attention rate each route reaches on one H200 (2048-token chunks, Llama-8B
heads, no context): jax's Mosaic GPU FA3 kernel (`attention_mgpu`, float16), jax's Triton flash
attention (`attention.mha`, KV heads repeated to 32), cuDNN, and our paged Triton kernel at pages
16 and 64 with wider tiles; then 256-sequence decode rows at 8k/32k.
`python benchmarks/prefill_routes_gpu.py OUT.json` (docs/benchmarks.md, session 5)."""
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import bench
from pallas_kernels.bench import time_chain, random_batch, attn_flops, HEADS, ours
out = {}
ceil = bench.ceilings(); out["ceil"] = ceil; print(ceil, flush=True)
mm = ceil["matmul_TFLOPs"]
def rec(name, secs, flops):
    out[name] = dict(us=secs * 1e6, pct=100 * flops / secs / 1e12 / mm)
    print(name, out[name], flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
def guard(name, fn):
    try: fn()
    except Exception as e: out[name] = repr(e)[-800:]; print(name, "ERR", repr(e)[-800:], flush=True)
for B in (1, 4):
    S = 2048
    flops = attn_flops([S] * B, [S] * B, HEADS)
    key = jax.random.key(B)
    q = jax.random.normal(key, (B, S, 32, 128), jnp.float16)
    k = jax.random.normal(jax.random.key(9), (B, S, 8, 128), jnp.float16)
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am
    for bq, bkv, st in [(64, 64, 2), (64, 128, 2), (64, 64, 3), (64, 128, 3), (128, 64, 2)]:
        cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st, causal=True)
        guard(f"mgpu B{B} {bq}/{bkv}/{st}", lambda: rec(f"mgpu B{B} {bq}/{bkv}/{st}", time_chain(
            lambda q, i, k: am.attention(q, k, k, cfg), q, k), flops))
    from jax.experimental.pallas.ops.gpu import attention as ta
    k32 = jnp.repeat(k, 4, axis=2).astype(jnp.bfloat16); qb = q.astype(jnp.bfloat16)
    for bq, bk, w, st in [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 2)]:
        bs = ta.BlockSizes(block_q=bq, block_k=bk)
        guard(f"triton_mha B{B} {bq}/{bk}/{w}/{st}", lambda: rec(f"triton_mha B{B} {bq}/{bk}/{w}/{st}", time_chain(
            lambda q, i, k: ta.mha(q, k, k, None, sm_scale=0.088, causal=True, block_sizes=bs, num_warps=w, num_stages=st), qb, k32), flops))
    kb = k.astype(jnp.bfloat16)
    guard(f"cudnn B{B}", lambda: rec(f"cudnn B{B}", time_chain(lambda q, i, k: jax.nn.dot_product_attention(
        q, k, k, scale=0.088, is_causal=True, implementation="cudnn"), qb, kb), flops))
    for page in (16, 64):
        b = random_batch(key, [S] * B, [S] * B, page_size=page, **HEADS)
        for t in [{}, dict(block_q=32, block_k=64, num_warps=8, num_stages=3),
                  dict(block_q=16, block_k=64, num_warps=4, num_stages=3),
                  dict(block_q=32, block_k=64, num_warps=4, num_stages=3),
                  dict(block_q=64, block_k=64, num_warps=8, num_stages=3),
                  dict(block_q=32, block_k=32, num_warps=4, num_stages=4)]:
            n = f"ours B{B} page{page} {t}"
            guard(n, lambda: rec(n, time_chain(ours(t), b["q"], b), flops))
for ctx in (8192, 32768):
    r = bench.guarded(bench.decode_case, jax.random.key(ctx), 256, ctx, ceil["copy_GBps"], {}, True)
    out[f"decode256x{ctx}"] = r; print(r, flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
