"""GPU check and benchmark of the Pallas kernels: `python -m pallas_kernels.bench [--out DIR]`.

1. Ceilings: HBM copy bandwidth (bytes read + written) and the bf16 matmul rate, measured here.
2. Correctness on the GPU (interpret mode hides races): random ragged batches, permuted block
   tables, NaN-poisoned outputs, every tiling that is timed, against the fp32 XLA reference.
3. Timings, side by side: decode against jax's Pallas paged_attention and the XLA reference;
   prefill (the Triton and the Mosaic GPU kernel) against cuDNN dense causal flash attention
   and the XLA reference; a mixed batch;
   the KV write (Pallas vs XLA scatter). Writes results.json under --out, prints a table last.
Timing: `ceilings.time_chain` (11 or 101 and 1 chained calls in one jit, the difference per
call), KV pages rotated among disjoint block-table copies so that small cases miss L2.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ceilings import measure_ceilings, time_chain
from pallas_kernels.kv_write import (rope_write_kv, rope_write_kv_reference, write_kv_pallas,
                                     write_kv_reference)
from pallas_kernels.ragged_paged_attention import (_triton_attention, ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu

warnings.filterwarnings("ignore", category=DeprecationWarning)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # Llama-3.1-8B
PAGE = 16
ROTATE_BYTES = 512 << 20  # rotate KV copies until a timed chain touches this much (L2: 60 MB)


def ceilings():
    """The device's copy bandwidth (GB/s) and bf16 matmul rate (TFLOP/s)."""
    c = measure_ceilings("bfloat16")
    return {"copy_GBps": c.hbm_bytes_per_s / 1e9, "matmul_TFLOPs": c.matmul_flops_per_s / 1e12}


def random_batch(key, q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, page_size=None,
                 dtype=jnp.bfloat16, max_seqs=None, num_tokens=None, copies=1):
    """Device-side random inputs; pages of `copies` disjoint block tables [copies, S, B]."""
    page_size = page_size or PAGE
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    num_seqs = len(q_lens)
    max_seqs = max_seqs or num_seqs
    pages = -(-kv_lens // page_size)
    max_pages = max(int(pages.max()), 1)
    per_copy = int(pages.sum())
    num_pages = copies * per_copy + 1
    kq, kk, kv, kp = jax.random.split(key, 4)
    perm = np.asarray(jax.random.permutation(kp, np.arange(1, num_pages)))
    tables = np.zeros((copies, max_seqs, max_pages), np.int32)
    for c in range(copies):
        starts = c * per_copy + np.concatenate([[0], np.cumsum(pages)])
        for s in range(num_seqs):
            tables[c, s, :pages[s]] = perm[starts[s]:starts[s + 1]]
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1:num_seqs + 1] = np.cumsum(q_lens)
    cu[num_seqs + 1:] = cu[num_seqs]
    lens = np.zeros(max_seqs, np.int32)
    lens[:num_seqs] = kv_lens
    num_tokens = num_tokens or int(cu[-1])
    cache = (num_pages, num_kv_heads, page_size, head_dim)
    return dict(q=jax.random.normal(kq, (num_tokens, num_q_heads, head_dim), dtype),
                k_cache=jax.random.normal(kk, cache, dtype),
                v_cache=jax.random.normal(kv, cache, dtype), kv_lens=jnp.asarray(lens),
                block_tables=jnp.asarray(tables), cu_q_lens=jnp.asarray(cu),
                num_seqs=jnp.asarray([num_seqs], jnp.int32))


def attn_args(b, copy=0):
    return (b["q"], b["k_cache"], b["v_cache"], b["kv_lens"], b["block_tables"][copy],
            b["cu_q_lens"], b["num_seqs"])


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def guarded(fn, *args, **kw):
    """Runs one case; an exception becomes a row, so one failure costs no other result."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        named = " ".join(str(a) for a in args if isinstance(a, (str, int, float)))
        return {"case": f"{fn.__name__} {named}", "ok": False, "rel_err": float("nan"),
                "error": repr(e)[-600:]}


def timed_variant(row: dict, check, call, x, *args, nbytes: float, copy_GBps: float,
                  **chain_kw) -> dict:
    """One variant of an experiment as a row: check()'s accuracy fields, then `time_chain`'s
    time and % of the copy bandwidth for nbytes; an exception becomes the row's error, so one
    failing variant costs no other result."""
    try:
        row.update(check())
        secs = time_chain(call, x, *args, reps=3, **chain_kw)
        row.update(us=secs * 1e6, pct_bw=100 * nbytes / secs / 1e9 / copy_GBps)
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[-400:]
    return row


def token_sweep_cli(cpu_tokens: tuple, gpu_tokens: tuple):
    """An experiment's command line (--out, --cpu, --tokens): (its args, the token counts:
    --tokens, else cpu_tokens or gpu_tokens, the copy bandwidth in GB/s to report against: 1
    on the CPU); --out is created."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--tokens", help="token counts, comma-separated (default: all)")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    counts = (tuple(int(t) for t in cli.tokens.split(",")) if cli.tokens
              else cpu_tokens if cli.cpu else gpu_tokens)
    copy = 1.0 if cli.cpu else measure_ceilings("bfloat16").hbm_bytes_per_s / 1e9
    return cli, counts, copy


def fp8_rows_variant(row: dict, fn, args: tuple, want: tuple, *, nbytes: float,
                     copy_GBps: float) -> dict:
    """timed_variant for fn(*args) -> (float8 values [R, C], per-row scales [R]): checked against
    want = (values, scales), timed chained on args[0] (each call's first input depends, in
    place, on the last call's outputs)."""
    want_q, want_s = want

    def call(x, i, *rest):
        q, s = jax.lax.optimization_barrier(fn(x, *rest))
        return x.at[0, 0].add((q[0, 0].astype(jnp.float32) * s[0] * 0).astype(x.dtype))

    def check():
        q, s = jax.jit(fn)(*args)
        diff = jnp.abs(q.astype(jnp.float32) - want_q.astype(jnp.float32))
        return dict(scale_rel_err=float(jnp.max(jnp.abs(s - want_s) / want_s)),
                    values_differing=float(jnp.mean(diff > 0)),
                    values_max_diff=float(jnp.max(diff)))

    return timed_variant(row, check, call, jnp.copy(args[0]), *args[1:], donate=True,
                         nbytes=nbytes, copy_GBps=copy_GBps)


def check_case(name, key, q_lens, kv_lens, heads, *, dtype=jnp.bfloat16, page_size=None,
               mosaic=False, fp8=False, **kw):
    """Triton: NaN-poisoned output, live rows checked. Mosaic (no output aliasing): padding
    rows must come back 0, and page 0, which only the block tables' unused entries name, is
    NaN: a kernel reading past a sequence's last page returns NaN. fp8 (with mosaic): a
    float8 cache with scales through the entry's Mosaic path (its prefill pages staged)."""
    b = random_batch(key, q_lens, kv_lens, dtype=dtype, page_size=page_size,
                     max_seqs=len(q_lens) + 3, num_tokens=int(np.sum(q_lens)) + 7, **heads)
    if fp8:
        b = dict(b, k_cache=(b["k_cache"] * 0.5).astype(jnp.float8_e4m3fn),
                 v_cache=(b["v_cache"] * 2.0).astype(jnp.float8_e4m3fn))
        kw = dict(kw, k_scale=2.0, v_scale=0.5)
    ref_kw = {k: v for k, v in kw.items()
              if k in ("sm_scale", "sliding_window", "soft_cap", "k_scale", "v_scale")}
    args = attn_args(b)
    ref = ragged_paged_attention_reference(*[a.astype(jnp.float32) if a.dtype == dtype else a
                                             for a in args], **ref_kw)
    live = int(np.sum(q_lens))
    if mosaic:
        q, k_cache, v_cache, *rest = args
        k_cache, v_cache = (c.at[0].set(jnp.nan) for c in (k_cache, v_cache))
        mosaic_kernel = (functools.partial(ragged_paged_attention, implementation="mosaic")
                         if fp8 else ragged_paged_attention_mgpu)
        out = mosaic_kernel(q, k_cache, v_cache, *rest, **kw)
        padding_zero = bool((np.asarray(out[live:], np.float32) == 0).all())
    else:
        out = jax.jit(functools.partial(_triton_attention, fill_value=float("nan"), **kw))(*args)
        padding_zero = True
    out, ref = np.asarray(out[:live], np.float32), np.asarray(ref[:live])
    err = rel_err(out, ref) if np.isfinite(out).all() else float("nan")
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
    return {"case": name, "rel_err": err, "ok": bool(err < tol and padding_zero),
            "padding_zero": padding_zero}


def correctness(decode_tiles, prefill_tiles):
    rng = np.random.default_rng(0)
    key = iter(jax.random.split(jax.random.key(42), 64))
    small = dict(num_q_heads=9, num_kv_heads=3, head_dim=64)
    results = [
        guarded(check_case, "9/3/64 mixed", next(key), [1, 0, 37, 1, 200, 1], [300, 0, 37, 1000, 700, 5],
                   small, sm_scale=0.125),
        guarded(check_case, "9/3/64 mixed split4", next(key), [1, 0, 37, 1, 200, 1],
                   [300, 0, 37, 1000, 700, 5], small, sm_scale=0.125, num_kv_splits=4),
        guarded(check_case, "32/8/128 fp32 P32 window+cap", next(key), [1, 64, 3], [500, 64, 1200], HEADS,
                   dtype=jnp.float32, page_size=32, sm_scale=0.088, sliding_window=100,
                   soft_cap=30.0),
        guarded(check_case, "32/8/128 P64 1x20000 decode", next(key), [1], [20000], HEADS, page_size=64,
                   sm_scale=0.088),
        guarded(check_case, "8/4/256 mixed (head dim 256)", next(key), [1, 40, 1], [900, 40, 77],
                   dict(num_q_heads=8, num_kv_heads=4, head_dim=256), sm_scale=0.0625),
    ]
    ctx = rng.integers(1, 3000, 64)
    for tiles in decode_tiles:
        results.append(guarded(check_case, f"decode 64 seqs {tiles}", next(key), [1] * 64, ctx, HEADS,
                                  sm_scale=0.088, **tiles))
    for tiles in prefill_tiles:
        results.append(guarded(check_case, f"prefill 300+700, 1 {tiles}", next(key), [300, 1, 5],
                                  [1000, 77, 5], HEADS, sm_scale=0.088, **tiles))
    mixed_q, mixed_kv = [1, 0, 37, 1, 200, 1, 300], [300, 0, 37, 1000, 700, 5, 1000]
    for tiles in MOSAIC_TILES:
        results.append(guarded(check_case, f"mosaic 32/8/128 mixed {tiles}", next(key), mixed_q,
                               mixed_kv, HEADS, mosaic=True, sm_scale=0.088, **tiles))
    for name, heads, page_size, dtype in [
            ("mosaic 64/8/128 P64", dict(HEADS, num_q_heads=64), 64, jnp.bfloat16),
            ("mosaic 8/8/64 P32", dict(num_q_heads=8, num_kv_heads=8, head_dim=64), 32,
             jnp.bfloat16),
            ("mosaic 16/8/128 P8 f16", dict(HEADS, num_q_heads=16), 8, jnp.float16)]:
        results.append(guarded(check_case, name, next(key), mixed_q, mixed_kv, heads,
                               page_size=page_size, dtype=dtype, mosaic=True, sm_scale=0.088))
    results.append(guarded(check_case, "mosaic 1 x 2048 chunk over 2048", next(key), [2048],
                           [4096], HEADS, mosaic=True, sm_scale=0.088))
    # float8 pages: the 300-token chunk's 1,000 keys overflow the staged pages (twice the
    # bucket's tokens), so it takes the Triton kernel beside the staged 37 and 200
    results.append(guarded(check_case, "mosaic fp8 pages, staged + Triton", next(key), mixed_q,
                           mixed_kv, HEADS, mosaic=True, fp8=True, sm_scale=0.088))
    results.append(guarded(check_case, "mosaic fp8 pages, 1 x 2048 chunk over 2048", next(key),
                           [2048], [4096], HEADS, mosaic=True, fp8=True, sm_scale=0.088))
    k_cache, v_cache = (jax.random.normal(next(key), (64, 8, PAGE, 128), jnp.bfloat16)
                        for _ in range(2))
    k, v = (jax.random.normal(next(key), (100, 8, 128), jnp.bfloat16) for _ in range(2))
    slots = jnp.asarray(rng.permutation(np.arange(PAGE, 64 * PAGE))[:100], jnp.int32)
    got = write_kv_pallas(k_cache, v_cache, k, v, slots)
    want = write_kv_reference(k_cache, v_cache, k, v, slots)
    same = all(bool(jnp.array_equal(g, w)) for g, w in zip(got, want))
    results.append({"case": "write_kv pallas == scatter", "rel_err": 0.0 if same else 1.0,
                    "ok": same})
    for cache_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        qkv = jax.random.normal(next(key), (100, 8, 6, 128), jnp.bfloat16)
        cos, sin = rope_angles(next(key), 100, 128)
        caches = tuple(c.astype(cache_dtype) for c in (k_cache, v_cache))
        got = rope_write_kv(*caches, qkv, cos, sin, slots)
        want = rope_write_kv_reference(*caches, qkv, cos, sin, slots)
        err = max(rel_err(g, w) for g, w in zip(got, want))
        results.append({"case": f"rope_write_kv {jnp.dtype(cache_dtype).name} pages",
                        "rel_err": err, "ok": err < 1e-2})
    return results


def rope_angles(key, num_tokens, head_dim):
    """cos, sin [T, 1, D / 2] of random positions (a rope of base 500,000)."""
    positions = jax.random.randint(key, (num_tokens, 1, 1), 0, 8192).astype(jnp.float32)
    angles = positions * 500000.0 ** (-jnp.arange(head_dim // 2) / (head_dim // 2))
    return jnp.cos(angles), jnp.sin(angles)


def kv_bytes(kv_lens, heads, itemsize=2):
    return int(np.sum(kv_lens)) * heads["num_kv_heads"] * heads["head_dim"] * 2 * itemsize


def attn_flops(q_lens, kv_lens, heads):
    """Causal: query i of a sequence sees kv_len - q_len + i + 1 keys; QK and PV, 2 FLOP a MAC."""
    total = sum(q * (k - q) + q * (q + 1) / 2 for q, k in zip(q_lens, kv_lens))
    return 4 * heads["num_q_heads"] * heads["head_dim"] * total


def ours(tiles, kernel=functools.partial(ragged_paged_attention, implementation="triton")):
    def call(q, i, b):
        args = attn_args(b, i % b["block_tables"].shape[0])
        return kernel(q, *args[1:], sm_scale=0.088, **tiles)
    return call


def mosaic(tiles):
    return ours(tiles, ragged_paged_attention_mgpu)


def xla_ref(q, i, b):
    args = attn_args(b, i % b["block_tables"].shape[0])
    return ragged_paged_attention_reference(q, *args[1:], sm_scale=0.088)


def jax_paged_decode(b):
    """jax's Pallas paged_attention wants pages [Hkv, N, P, D] (ours are [N, Hkv, P, D]) and
    tables without padding rows.
    -> (call, q, pages, b): the pages go in as arguments (closed over, XLA would embed them as a
    constant: a segfault at 8 GB)."""
    pages = {n: jnp.swapaxes(b[n], 0, 1) for n in ("k_cache", "v_cache")}
    k_splits = math.gcd(16, b["block_tables"].shape[-1])

    def call(q, i, pages, b):
        table = b["block_tables"][i % b["block_tables"].shape[0]]
        return jax_paged.paged_attention(q * 0.088, pages["k_cache"], pages["v_cache"], table,
                                         b["kv_lens"], k_splits=k_splits)
    return call, b["q"], pages, b


def decode_case(key, num_seqs, ctx, copy_GBps, tiles, with_peers):
    nbytes = kv_bytes([ctx] * num_seqs, HEADS)
    copies = max(1, min(11, -(-ROTATE_BYTES // nbytes)))
    b = random_batch(key, [1] * num_seqs, [ctx] * num_seqs, copies=copies, **HEADS)
    row = {"kind": "decode", "seqs": num_seqs, "ctx": ctx, "floor_us": nbytes / copy_GBps / 1e3}
    impls = {"ours": ours(tiles)}
    if with_peers and nbytes <= (8 << 30):
        impls["jax_paged"] = jax_paged_decode(b)
    if with_peers and num_seqs * ctx <= 8 * 2048:  # the scan over all pages is slow (~1% of bw)
        impls["xla"] = xla_ref
    for name, call in impls.items():
        try:
            call, q, *args = call if isinstance(call, tuple) else (call, b["q"], b)
            secs = time_chain(call, q, *args)
            row[f"{name}_us"] = secs * 1e6
            row[f"{name}_pct_bw"] = 100 * nbytes / secs / 1e9 / copy_GBps
        except Exception as e:  # a peer's limits must not stop the run
            row[f"{name}_error"] = repr(e)[:300]
    return row


def prefill_case(key, num_seqs, chunk, ctx, mm_TFLOPs, tiles, with_peers):
    q_lens, kv_lens = [chunk] * num_seqs, [ctx + chunk] * num_seqs
    b = random_batch(key, q_lens, kv_lens, **HEADS)
    flops = attn_flops(q_lens, kv_lens, HEADS)
    row = {"kind": "prefill", "seqs": num_seqs, "chunk": chunk, "ctx": ctx,
           "floor_us": flops / mm_TFLOPs / 1e6}
    impls = {"ours": ours(tiles)}
    impls.update({f"mosaic{i}": mosaic(t) for i, t in enumerate(MOSAIC_TILES)})
    if with_peers and chunk * (ctx + chunk) <= 512 * 2560:
        impls["xla"] = xla_ref
    if with_peers and ctx == 0:
        q4 = b["q"].reshape(num_seqs, chunk, HEADS["num_q_heads"], HEADS["head_dim"])
        kv4 = [jax.random.normal(k, (num_seqs, chunk, HEADS["num_kv_heads"], HEADS["head_dim"]),
                                 jnp.bfloat16) for k in jax.random.split(key, 2)]
        impls["cudnn"] = (lambda q, i, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=0.088, is_causal=True, implementation="cudnn"), q4, *kv4)
    for name, call in impls.items():
        try:
            call, q, *args = call if isinstance(call, tuple) else (call, b["q"], b)
            secs = time_chain(call, q, *args)
            row[f"{name}_us"] = secs * 1e6
            row[f"{name}_pct_mm"] = 100 * flops / secs / 1e12 / mm_TFLOPs
        except Exception as e:
            row[f"{name}_error"] = repr(e)[:300]
    return row


def mixed_case(key, ceil, tiles):
    q_lens, kv_lens = [1] * 64 + [512], [2048] * 64 + [2560]
    b = random_batch(key, q_lens, kv_lens, max_seqs=72, num_tokens=640, **HEADS)
    nbytes, flops = kv_bytes(kv_lens, HEADS), attn_flops(q_lens, kv_lens, HEADS)
    floor = max(nbytes / ceil["copy_GBps"] / 1e9, flops / ceil["matmul_TFLOPs"] / 1e12)
    row = {"kind": "mixed 64x2048 decode + 512 over 2048", "floor_us": floor * 1e6}
    impls = {"ours": ours(tiles), "xla": xla_ref}
    impls.update({f"mosaic{i}": mosaic(t) for i, t in enumerate(MOSAIC_TILES)})
    for name, call in impls.items():
        secs = time_chain(call, b["q"], b)
        row[f"{name}_us"], row[f"{name}_pct_floor"] = secs * 1e6, 100 * floor / secs
    return row


def kv_write_case(key, num_tokens, copy_GBps):
    shape = (16384, 8, PAGE, 128)  # 512 MiB per cache
    k_cache, v_cache = (jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key))
    kv = jax.random.normal(key, (num_tokens, 8, 128), jnp.bfloat16)
    slots = jax.random.permutation(key, shape[0] * PAGE)[:11 * num_tokens].reshape(11, -1)
    nbytes = 2 * 2 * kv.nbytes  # read k, v; write them into the caches
    row = {"kind": "kv_write", "tokens": num_tokens, "floor_us": nbytes / copy_GBps / 1e3}
    for name, fn in {"pallas": write_kv_pallas, "xla": write_kv_reference}.items():
        def call(caches, i, kv, fn=fn):  # in place on the donated caches
            return fn(*caches, kv, kv, slots[i].astype(jnp.int32))
        fresh = (jnp.copy(k_cache), jnp.copy(v_cache))
        row[f"{name}_us"] = time_chain(call, fresh, kv, donate=True) * 1e6
    # from the fused QKV GEMM's output (an 8B's 4 query heads a KV head): q roped out, k roped
    # and v into the caches, one kernel against XLA's (the scatters, k's rope inside, q's rope)
    qkv = jax.random.normal(key, (num_tokens, 8, 6, 128), jnp.bfloat16)
    cos, sin = rope_angles(key, num_tokens, 128)
    row["rope_floor_us"] = 2 * qkv.nbytes / copy_GBps / 1e3  # read qkv; write q, k, v
    for name, fn in {"rope_pallas": rope_write_kv, "rope_xla": rope_write_kv_reference}.items():
        def call(state, i, qkv, fn=fn):  # state: the caches and the last q (kept live)
            q, *caches = fn(*state[:2], qkv, cos, sin, slots[i].astype(jnp.int32))
            return (*caches, q)
        fresh = (jnp.copy(k_cache), jnp.copy(v_cache), jnp.zeros((num_tokens, 32, 128), qkv.dtype))
        row[f"{name}_us"] = time_chain(call, fresh, qkv, donate=True) * 1e6
    return row


def sweep(run_case, candidates):
    """Times each tiling on one case; returns the fastest and all rows."""
    rows = []
    for tiles in candidates:
        rows.append(dict(guarded(run_case, tiles), tiles=tiles))  # a failure is a row
        print("sweep", rows[-1], flush=True)
    # failed rows (no time) and times below the resolution (nan) sort last
    best = min(rows, key=lambda r: r["ours_us"] if r.get("ours_us", 0) > 0 else math.inf)
    return best["tiles"], rows


DECODE_TILES = [dict(block_k=64, num_warps=4, num_stages=2), dict(block_k=64, num_warps=4, num_stages=3),
                dict(block_k=128, num_warps=4, num_stages=2), dict(block_k=128, num_warps=8, num_stages=3),
                dict(block_k=32, num_warps=4, num_stages=4)]

PREFILL_TILES = [dict(block_q=16, block_k=64, num_warps=4, num_stages=2),
                 dict(block_q=16, block_k=64, num_warps=4, num_stages=3),
                 dict(block_q=32, block_k=64, num_warps=8, num_stages=2),
                 dict(block_q=32, block_k=128, num_warps=8, num_stages=2)]

# the Mosaic GPU prefill kernel's tilings, KV tile x ring depth (shared memory: 2 x 2 x 64 x 128
# 16-bit for Q and its staging rows, num_stages x block_kv x 128 for each of K and V)
MOSAIC_TILES = [dict(block_kv=128, num_stages=2), dict(block_kv=64, num_stages=3)]


SECTIONS = ("correctness", "sweep", "split_sweep", "decode", "prefill", "mixed", "kv_write")


def split_sweep(key, copy_GBps):
    """Batch-1 long-context decode: KV split count x KV tile, explicit (the default picks one)."""
    rows = []
    for ctx in (8192, 32768):
        for block_k in (64, 128):
            for splits in (16, 33, 66, 132):
                tiles = dict(block_k=block_k, num_kv_splits=splits, num_warps=4, num_stages=2)
                rows.append(dict(guarded(decode_case, key, 1, ctx, copy_GBps, tiles, False),
                                 tiles=tiles))
                print(rows[-1], flush=True)
    return rows


def main():
    global PAGE  # --page-size sets it for every case
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--decode-seqs", default="1,8,64,256")
    parser.add_argument("--page-size", type=int, default=PAGE,
                        help="the rows' page size (the engine's --block-size)")
    args = parser.parse_args()
    PAGE = args.page_size
    os.makedirs(args.out, exist_ok=True)
    sections = set(args.sections.split(","))
    log = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "correctness": [],
           "decode_sweep": [], "prefill_sweep": [], "rows": []}
    save = lambda: open(f"{args.out}/results.json", "w").write(json.dumps(log, indent=1))
    log["ceilings"] = ceil = ceilings()
    print("ceilings", ceil, flush=True)
    if "correctness" in sections:
        log["correctness"] = correctness(DECODE_TILES, PREFILL_TILES)
        for r in log["correctness"]:
            print(f"check {r['case']:<60} rel_err {r['rel_err']:.2e} "
                  f"{'ok' if r['ok'] else 'FAIL'}", r.get("error", ""))
        save()
    keys = iter(jax.random.split(jax.random.key(7), 256))
    key = next(keys)
    dec_tiles, pre_tiles = {}, {}  # the kernel's defaults unless swept
    if "sweep" in sections:
        dec_tiles, log["decode_sweep"] = sweep(
            lambda t: decode_case(key, 64, 2048, ceil["copy_GBps"], t, False), DECODE_TILES)
        pre_tiles, log["prefill_sweep"] = sweep(
            lambda t: prefill_case(key, 1, 2048, 0, ceil["matmul_TFLOPs"], t, False),
            PREFILL_TILES)
        save()
    if "split_sweep" in sections:
        log["split_sweep"] = split_sweep(key, ceil["copy_GBps"])
        save()
    rows = log["rows"]
    if "decode" in sections:
        for num_seqs in map(int, args.decode_seqs.split(",")):
            for ctx in (512, 2048, 8192, 32768):
                rows.append(guarded(decode_case, next(keys), num_seqs, ctx, ceil["copy_GBps"],
                                    dec_tiles, True))
                print(rows[-1], flush=True)
                save()
    if "prefill" in sections:
        for num_seqs, chunk, ctx in [(1, 512, 0), (1, 512, 2048), (1, 512, 8192), (1, 2048, 0),
                                     (1, 2048, 2048), (1, 2048, 8192), (4, 2048, 0)]:
            rows.append(guarded(prefill_case, next(keys), num_seqs, chunk, ctx,
                                ceil["matmul_TFLOPs"], pre_tiles, True))
            print(rows[-1], flush=True)
            save()
    if "mixed" in sections:
        rows.append(guarded(mixed_case, next(keys), ceil, pre_tiles))
        print(rows[-1], flush=True)
    if "kv_write" in sections:
        for num_tokens in (1, 64, 512, 2048):
            rows.append(guarded(kv_write_case, next(keys), num_tokens, ceil["copy_GBps"]))
            print(rows[-1], flush=True)
    save()
    print_table(log, dec_tiles, pre_tiles)


def print_table(log, dec_tiles, pre_tiles):
    print(f"\n{log['device']} jax {log['jax']}  copy {log['ceilings']['copy_GBps']:.0f} GB/s  "
          f"bf16 mm {log['ceilings']['matmul_TFLOPs']:.0f} TFLOP/s")
    print("decode sweep (64x2048):", [(r["tiles"], round(r.get("ours_us", -1), 1))
                                      for r in log["decode_sweep"]])
    print("prefill sweep (2048):", [(r["tiles"], round(r.get("ours_us", -1), 1))
                                    for r in log["prefill_sweep"]])
    print("chosen", dec_tiles, pre_tiles)
    for r in log["rows"]:
        cells = [f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                 if not k.endswith("error")]
        errs = [k for k in r if k.endswith("error")]
        print(" ".join(cells), ("ERR " + ",".join(errs)) if errs else "")
    bad = [c["case"] for c in log["correctness"] if not c["ok"]]
    print("correctness:", "all ok" if not bad else f"FAILED {bad}")


if __name__ == "__main__":
    main()
