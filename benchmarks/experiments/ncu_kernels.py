"""A driver for Nsight Compute: one launch of each kernel named, at the 8B's shapes and the
product's default tiles, so that `ncu` reads their hardware counters (what bounds a kernel that
streams below the copy bandwidth: memory, issue, latency, occupancy).

    ncu --clock-control none --set full -k regex:'ragged_paged|int4_gemv|fp8_gemv|silu_mul' \\
        -o DIR/prof python benchmarks/experiments/ncu_kernels.py [--cases NAME ...]

Cases: attention over 512 sequences x 1536 tokens of bf16 and of float8 pages (the decode
bucket; float8 also at other tiles), and a prefill bucket's on float8 pages; the int4 (group
128) and FP8 one-token GEMVs on the four projections; the FP8 MLP's SwiGLU quantisation
(silu_mul_fp8's two kernels) at T tokens: swiglu_T at the default tiles, swiglu_T_rR_cC_wW[_bB]
at R rows x C columns, W warps and B row blocks a program; the prompts' launch of a 1000/1000
run's mixed step on float8 pages (PREFILL_STEP: 500 decodes at 1,200 tokens, a prompt's last 548
tokens and a whole 1,000-token prompt): prefill_fp8 at the default tiles,
prefill_fp8_qQ_kK_wW_sS at block_q Q, block_k K, W warps and S stages. The same prompts (548 new
tokens at 1,000, a whole 1,000-token prompt) alone, on bf16 pages: prompts_mosaic_bf16 (the
Mosaic GPU prefill kernel: wgmma, which reads 16-bit pages only) and prompts_triton_bf16 (this
kernel at its prefill tiles); and prompts_dequant, the gather of those prompts' float8 pages out
of the whole step's cache, widened to bf16 (what a 16-bit copy for the Mosaic kernel would
cost). Every program is compiled before any launches, and each case is launched once (or
--launches times).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import gemv_gpu  # noqa: E402  (sets XLA_FLAGS: each kernel launched on its own)
import fp8_kv_attention_gpu  # noqa: E402
import silu_mul_fp8_gpu  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels import fp8_gemv, int4_gemv  # noqa: E402
from pallas_kernels.bench import HEADS, attn_args, random_batch  # noqa: E402
from pallas_kernels.ragged_paged_attention import (_triton_attention,  # noqa: E402
                                                   ragged_paged_attention)
from pallas_kernels.silu_mul_fp8 import silu_mul_fp8  # noqa: E402

FP8 = jnp.float8_e4m3fn


def attention_case(cache: str, num_seqs: int = 512, ctx: int = 1536, **tiles):
    b = random_batch(jax.random.key(0), [1] * num_seqs, [ctx] * num_seqs, **HEADS)
    if cache == "fp8":
        b = dict(b, k_cache=b["k_cache"].astype(FP8), v_cache=b["v_cache"].astype(FP8))
    scale = {} if cache == "bf16" else dict(k_scale=2.0)
    return (lambda *a: ragged_paged_attention(*a, sm_scale=0.088, **scale, **tiles)), attn_args(b)


def mixed_case(**decode_tiles):
    """A prefill bucket on float8 pages: 511 decodes at 1536 and a 1536-token prompt; the
    entry's two launches (fp8_kv_attention_gpu's "split" variant), the decodes' at their
    default tiles or at decode_block_k."""
    q_lens, kv_lens = [1] * 511 + [1536], [1536] * 512
    b = random_batch(jax.random.key(0), q_lens, kv_lens, num_tokens=2048, **HEADS)
    b = dict(b, k_cache=b["k_cache"].astype(FP8), v_cache=b["v_cache"].astype(FP8))
    kw = dict(only="split", **decode_tiles)
    return (lambda *a: fp8_kv_attention_gpu.attention(a[0], a, "fp8", False, kw)), attn_args(b)


PREFILL_STEP = ([1] * 500 + [548, 1000], [1200] * 500 + [1000, 1000])  # (q_lens, kv_lens)


def prefill_batch():
    """The mixed step of PREFILL_STEP on float8 pages (k_scale 2), a 2,048-token bucket."""
    b = random_batch(jax.random.key(0), *PREFILL_STEP, num_tokens=2048, **HEADS)
    return dict(b, k_cache=(b["k_cache"] * 0.5).astype(FP8), v_cache=b["v_cache"].astype(FP8))


def prefill_case(name: str):
    """prefill_fp8 (the default tiles) or prefill_fp8_qQ_kK_wW_sS: the prompts' launch alone."""
    keys = {"q": "block_q", "k": "block_k", "w": "num_warps", "s": "num_stages"}
    tiles = {keys[v[0]]: int(v[1:]) for v in name.split("_")[2:]}
    return (lambda *a: _triton_attention(*a, sm_scale=0.088, k_scale=2.0, only="prefill",
                                         **tiles)), attn_args(prefill_batch())


PROMPTS = ([548, 1000], [1000, 1000])  # PREFILL_STEP's prompts


def prompts_case(kernel: str):
    """PROMPTS alone on bf16 pages (a 2,048-token bucket) through the Mosaic or the Triton
    kernel."""
    b = random_batch(jax.random.key(0), *PROMPTS, num_tokens=2048, **HEADS)
    return (lambda *a: ragged_paged_attention(*a, sm_scale=0.088, implementation=kernel)), (
        attn_args(b))


def prompts_dequant_case():
    """PREFILL_STEP's two prompts' float8 pages (K and V) gathered out of the step's cache and
    widened to bf16."""
    b = prefill_batch()
    pages_per_prompt = -(-max(PROMPTS[1]) // b["k_cache"].shape[2])
    pages = b["block_tables"][0][-len(PROMPTS[0]):, :pages_per_prompt].reshape(-1)
    return (lambda k, v, p: (k[p].astype(jnp.bfloat16), v[p].astype(jnp.bfloat16))), (
        b["k_cache"], b["v_cache"], pages)


def gemv_case(weights: str, proj: str):
    k, n = gemv_gpu.SHAPES["gpu"][proj]
    [w] = gemv_gpu.make_weights(weights, k, n, 1, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (1, k), jnp.bfloat16)
    if weights == "int4":
        return (lambda x, *w: int4_gemv.int4_gemv(x, *w)), (x, *w)
    if proj in gemv_gpu.NORMED:
        return (lambda x, v, s, g: fp8_gemv.fp8_gemv(x, v, s, norm_weight=g, eps=1e-5)), (x, *w)
    return (lambda x, v, s, g: fp8_gemv.fp8_gemv(x, v, s)), (x, *w)


CASES = {"attn_bf16": lambda: attention_case("bf16"), "attn_fp8": lambda: attention_case("fp8"),
         **{f"attn_fp8_{name}": (lambda t=t: attention_case("fp8", **t)) for name, t in (
             ("k64", dict(block_k=64)), ("k256", dict(block_k=256)),
             ("s3", dict(block_k=128, num_stages=3)))},
         "mixed_fp8": mixed_case, "mixed_fp8_k64": lambda: mixed_case(decode_block_k=64),
         "prompts_mosaic_bf16": lambda: prompts_case("mosaic"),
         "prompts_triton_bf16": lambda: prompts_case("triton"),
         "prompts_dequant": prompts_dequant_case,
         **{f"{w}_{p}": (lambda w=w, p=p: gemv_case(w, p))
            for w in ("int4", "fp8") for p in ("qkv", "o", "gate_up", "down")}}


def swiglu_case(name: str):
    """swiglu_T (the default tiles) or swiglu_T_rR_cC_wW[_bB]: T tokens, blocks of R rows x C
    columns, W warps, B blocks a program."""
    tokens, *tiles = (int(v[1:] if v[0] in "rcwb" else v) for v in name.split("_")[1:])
    kw = dict(zip(("block_rows", "block_cols", "num_warps", "row_blocks"), tiles))
    return (functools.partial(silu_mul_fp8, **kw), silu_mul_fp8_gpu.swiglu_inputs(tokens, 14336))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=[*CASES, "swiglu_512", "swiglu_2048"])
    parser.add_argument("--launches", type=int, default=1,
                        help="launches of each case in turn (2: the second finds its input "
                             "in L2 where it fits, as after the GEMM that wrote it)")
    cli = parser.parse_args()
    programs = {}
    for name in cli.cases:
        fn, args = (swiglu_case(name) if name.startswith("swiglu_")
                    else prefill_case(name) if name.startswith("prefill_") else CASES[name]())
        programs[name] = (jax.jit(fn).lower(*args).compile(), args)
    for name, (compiled, args) in programs.items():
        print(name, flush=True)
        for _ in range(cli.launches):
            jax.block_until_ready(compiled(*args))


if __name__ == "__main__":
    main()
