"""What Triton makes of the attention kernel, on the CPU machine: registers, spills and the K/V
load pipeline of one tiling, before any GPU time is spent on it.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install triton        # the compiler, with ptxas
    python benchmarks/experiments/triton_report.py --out /tmp/ttir [--block-q 16 --block-k 64 ...]
    python benchmarks/experiments/triton_report.py --out /tmp/ttir --jax-mha          # the dense peer
    /tmp/tv/bin/python benchmarks/experiments/triton_report.py --compile /tmp/ttir/kernel.ttir --num-warps 4

The first step (jax's Python) lowers one bucket of `ragged_paged_attention` (default the prefill
bucket: 2048 tokens, 4 sequences; Llama-3.1-8B heads, 16-token pages) under an abstract H200 and
writes the Triton IR Pallas emits.
The second (the triton package's Python; it need not match the Triton inside jaxlib exactly)
compiles it for sm_90 and prints, per loop, the async copies and the depth of their waits
(`num = 0`: every copy waits out, nothing overlaps compute) and ptxas's register and spill count.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys


def lower_capturing_ttir():
    """(lower_for_h200, modules): tests/conftest's lowering under an abstract H200, with each
    Triton module Pallas emits appended to `modules` (str(m.module) is the IR)."""
    from jax._src.pallas.triton import lowering

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from conftest import lower_for_h200

    modules = []
    lower = lowering.lower_jaxpr_to_triton_module
    lowering.lower_jaxpr_to_triton_module = lambda *x, **k: modules.append(lower(*x, **k)) or modules[-1]
    return lower_for_h200, modules


def write_ttir(a) -> None:
    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    lower_for_h200, modules = lower_capturing_ttir()
    sds = jax.ShapeDtypeStruct
    cache = sds((512, 8, 16, 128), jnp.dtype(a.kv_dtype))
    s = a.max_seqs
    args = (sds((a.num_tokens, 32, 128), jnp.bfloat16), cache, cache, sds((s,), jnp.int32),
            sds((s, 256), jnp.int32), sds((s + 1,), jnp.int32), sds((1,), jnp.int32))
    tiles = {k: v for k, v in dict(block_q=a.block_q, block_k=a.block_k).items() if v}
    if a.jax_mha:  # the peer: jax's dense Triton flash attention, causal, 64 x 64 tiles
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import attention
        q = sds((1, a.num_tokens, 32, 128), jnp.bfloat16)
        lower_for_h200(functools.partial(
            attention.mha, segment_ids=None, sm_scale=0.088, causal=True,
            block_sizes=attention.BlockSizes(block_q=64, block_k=64), num_warps=4,
            num_stages=3), q, q, q)
    else:
        scales = {} if a.kv_dtype == "bfloat16" else dict(k_scale=2.0, v_scale=0.5)
        lower_for_h200(functools.partial(ragged_paged_attention, sm_scale=0.088,
                                         **tiles, **scales), *args)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "kernel.ttir"), "w") as f:
        f.write(str(modules[-1].module))
    print("wrote", os.path.join(a.out, "kernel.ttir"))


def compile_and_report(a) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    kernel = triton.compile(a.compile, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=a.num_warps, num_stages=a.num_stages))
    ttgir = kernel.asm["ttgir"]
    for i, loop in enumerate(ttgir.split("scf.for")[1:]):
        body = loop.split("scf.yield")[0]
        waits = re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", body)
        print(f"loop {i}: {body.count('async_copy_global_to_local')} async copies, waits "
              f"num={waits}, {body.count(' tt.load ')} plain loads, "
              f"{body.count('warp_group_dot ')} wgmma")
    ptx = a.compile + ".ptx"
    with open(ptx, "w") as f:
        f.write(kernel.asm["ptx"])
    try:
        ptxas = get_ptxas(90)
    except TypeError:  # triton >= 3.5 takes no arch
        ptxas = get_ptxas()
    result = subprocess.run([getattr(ptxas, "path", ptxas), "-v", "--gpu-name=sm_90a", ptx,
                             "-o", ptx + ".cubin"], capture_output=True, text=True)
    print("\n".join(line.strip() for line in (result.stdout + result.stderr).splitlines()
                    if "registers" in line or "spill" in line))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the Triton IR here (jax's Python)")
    parser.add_argument("--jax-mha", action="store_true", help="jax's dense kernel instead")
    parser.add_argument("--num-tokens", type=int, default=2048, help="the bucket (decode: = seqs)")
    parser.add_argument("--max-seqs", type=int, default=4)
    parser.add_argument("--kv-dtype", default="bfloat16", help="the pages' dtype (float8_e4m3fn)")
    parser.add_argument("--block-q", type=int)
    parser.add_argument("--block-k", type=int)
    parser.add_argument("--compile", help="a .ttir to compile and report on (triton's Python)")
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    a = parser.parse_args()
    if a.compile:
        compile_and_report(a)
    else:
        write_ttir(a)


if __name__ == "__main__":
    main()
