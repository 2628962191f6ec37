"""What Triton makes of the GEMV kernels (int4_gemv, fp8_gemv), on the CPU machine: registers,
spills, occupancy and the SASS instruction mix of the main loop per weight, before any GPU time.

    python -m venv /tmp/tv && /tmp/tv/bin/pip install triton        # the compiler, with ptxas
    python benchmarks/experiments/gemv_report.py --kernel int4 --k 4096 --n 28672 \
        [--group 128 --block-n 256 --num-warps 8 --splits 8] --triton-python /tmp/tv/bin/python
    python benchmarks/experiments/gemv_report.py --kernel fp8 --k 4096 --n 28672 \
        [--block-n 32 --block-k 256 --num-warps 4] --triton-python /tmp/tv/bin/python

The first step (jax's Python) lowers one call at [1, K] bf16 under an abstract H200 and writes
the Triton IR Pallas emits to --out. The second (the triton package's Python, run in a
subprocess; its Triton need not match jaxlib's exactly: an estimate) compiles it for sm_90,
runs ptxas -v and nvdisasm, and prints the innermost loop with the most global loads (the
weights' loop): its SASS opcodes per iteration and per weight (--out keeps the .ttgir, .ptx and
.sass to read). Per-weight counts are a warp's instructions over the weights a warp handles an
iteration; one SM issues 4 warp instructions a clock (1 a scheduler), so at the H200's ~1.98 GHz
the issue rate alone caps the weights/s at 132 * 4 * 1.98e9 * 32 / (instructions a weight),
printed as a bandwidth of weight bytes.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys

REGS_PER_SM, MAX_WARPS_PER_SM, MAX_PROGRAMS_PER_SM, SMEM_PER_SM = 65536, 64, 32, 228 * 1024
ISSUE_PER_S = 132 * 4 * 1.98e9  # warp instructions a second, the whole H200
BYTES_PER_WEIGHT = {"int4": 0.5, "fp8": 1.0}


def write_ttir(a) -> None:
    """Lowers the kernel and writes kernel.ttir and meta.json (num_warps, weights an iteration)."""
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from triton_report import lower_capturing_ttir

    lower_for_h200, modules = lower_capturing_ttir()
    sds = jax.ShapeDtypeStruct
    x = sds((a.m, 2 * a.k if a.swiglu else a.k), jnp.bfloat16)
    # the product's single-device layout: per-layer small operands stacked, read at a row
    lead, layer = ((a.layers,), a.layers - 1) if a.layers else ((), None)
    if a.kernel == "int4":
        from pallas_kernels.int4_gemv import DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, int4_gemv
        kernel = int4_gemv
        a.block_n, a.num_warps = a.block_n or DEFAULT_BLOCK_N, a.num_warps or DEFAULT_NUM_WARPS
        groups = a.k // a.group
        lower_for_h200(functools.partial(kernel, block_n=a.block_n, num_warps=a.num_warps,
                                         splits=a.splits, layer=layer),
                       x, sds((a.k // 8, a.n), jnp.int32), sds((*lead, groups, a.n), jnp.bfloat16),
                       sds((*lead, groups, a.n), jnp.uint8))
        weights = 128 * a.block_n  # a 128-row chunk of the tile
    else:
        from pallas_kernels.fp8_gemv import DEFAULT_TILE, FP8, fp8_gemv
        kernel = fp8_gemv
        a.block_n, a.block_k = a.block_n or DEFAULT_TILE[0], a.block_k or DEFAULT_TILE[1]
        a.num_warps = a.num_warps or 4
        norm = (sds((*lead, a.k), jnp.bfloat16),) if a.norm else ()
        lower_for_h200(functools.partial(kernel, block_n=a.block_n, block_k=a.block_k,
                                         num_warps=a.num_warps, splits=a.splits, layer=layer,
                                         swiglu=a.swiglu),
                       x, sds((a.n, a.k), FP8), sds((*lead, a.n), jnp.float32), *norm)
        weights = a.block_n * a.block_k  # a K tile
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "kernel.ttir"), "w") as f:
        # the triton package's parser (3.9) reads no eviction policy where jaxlib's Triton
        # prints it; the hint changes no layout or instruction count
        f.write(str(modules[-1].module).replace(" evictionPolicy = evict_first", ""))
    with open(os.path.join(a.out, "meta.json"), "w") as f:
        json.dump(dict(num_warps=a.num_warps, weights=weights, kernel=a.kernel), f)
    print(f"{a.kernel}_gemv [1, {a.k}] x [{a.k}, {a.n}] block_n {a.block_n} num_warps "
          f"{a.num_warps}: wrote {a.out}/kernel.ttir")


def occupancy(regs: int, smem: int, num_warps: int) -> int:
    """Programs resident on one SM: registers (a warp's allocated 8 a thread at a time), the
    2048 threads, the 32 blocks and shared memory."""
    by_regs = REGS_PER_SM // (-(-regs // 8) * 8 * 32) // num_warps
    by_smem = SMEM_PER_SM // smem if smem else MAX_PROGRAMS_PER_SM
    return min(by_regs, MAX_WARPS_PER_SM // num_warps, MAX_PROGRAMS_PER_SM, by_smem)


def weights_loop(sass: str) -> list[str]:
    """The innermost loop (label to the branch back to it) with the most global loads: its
    instructions' opcodes, predicates dropped."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    loops = []  # (first line, last line)
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\s+(?:`\()?(\.L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    innermost = [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e)
                                                     for s2, e2 in loops)]
    bodies = [[re.sub(r"^@!?U?P\w+\s+", "", op.group(1)).split()[0]
               for op in (re.search(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", x)
                          for x in lines[s:e + 1]) if op] for s, e in innermost]
    return max(bodies, key=lambda ops: sum(op.startswith("LDG") for op in ops))


def compile_and_report(a) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    with open(os.path.join(a.compile, "meta.json")) as f:
        meta = json.load(f)
    num_warps = meta["num_warps"]
    kernel = triton.compile(os.path.join(a.compile, "kernel.ttir"),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=3))
    for ext in ("ttgir", "llir", "ptx"):
        with open(os.path.join(a.compile, "kernel." + ext), "w") as f:
            f.write(kernel.asm[ext])
    ptx, cubin = (os.path.join(a.compile, "kernel." + e) for e in ("ptx", "cubin"))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", cubin],
                         capture_output=True, text=True, check=True)
    info = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups()
    smem = kernel.metadata.shared
    programs = occupancy(regs, smem, num_warps)
    print(f"registers {regs}, spill stores/loads {'/'.join(spills)} bytes, shared {smem} bytes"
          f" -> {programs} programs ({programs * num_warps} warps) an SM")
    sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "nvdisasm"), "-c", cubin],
                          capture_output=True, text=True, check=True).stdout
    with open(os.path.join(a.compile, "kernel.sass"), "w") as f:
        f.write(sass)
    ops = weights_loop(sass)
    per_warp = meta["weights"] / num_warps  # weights a warp handles an iteration
    counts = collections.Counter(op.split(".")[0] for op in ops)
    print(f"main loop: {len(ops)} instructions an iteration, {meta['weights']} weights "
          f"({per_warp / 32:g} a thread): {32 * len(ops) / per_warp:.2f} a weight")
    for op, n in counts.most_common():
        print(f"  {op:8s} {n:5d}  {32 * n / per_warp:6.3f} a weight")
    cap = ISSUE_PER_S * per_warp / len(ops) * BYTES_PER_WEIGHT[meta["kernel"]]
    print(f"issue-bound ceiling: {cap / 1e12:.2f} TB/s of weights")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", choices=("int4", "fp8"),
                        default="int4")
    parser.add_argument("--m", type=int, default=1, help="rows of x")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=28672)
    parser.add_argument("--group", type=int, default=128, help="int4's group")
    parser.add_argument("--block-n", type=int)
    parser.add_argument("--block-k", type=int, help="fp8's K tile")
    parser.add_argument("--num-warps", type=int)
    parser.add_argument("--splits", type=int)
    parser.add_argument("--layers", type=int, default=32,
                        help="scales (zeros, norm) stacked across this many layers, read at the "
                             "last, as on one device; 0: one layer's own arrays")
    parser.add_argument("--norm", action="store_true", help="fp8: the input norm inside")
    parser.add_argument("--swiglu", action="store_true",
                        help="fp8: x a gate/up row, SwiGLU inside (a down projection)")
    parser.add_argument("--out", default="/tmp/gemv_report")
    parser.add_argument("--triton-python", help="the triton venv's python: compile and report")
    parser.add_argument("--compile", help="(triton's Python) a --out directory to report on")
    a = parser.parse_args()
    if (a.swiglu or a.norm) and a.kernel != "fp8":
        parser.error("--swiglu and --norm are the FP8 GEMV's")
    if a.compile:
        compile_and_report(a)
        return
    write_ttir(a)
    if a.triton_python:
        subprocess.run([a.triton_python, __file__, "--compile", a.out], check=True)


if __name__ == "__main__":
    main()
