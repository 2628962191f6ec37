"""The SASS that jaxlib's own Triton makes of a Pallas kernel, on a machine without a GPU: one
kernel call compiled for an H200 (XLA's deviceless compilation, as deviceless_step.py), its
PTX and cubin captured from ptxas, then per loop the instruction count and the mix of opcodes,
and ptxas's registers and spills. triton_report.py and gemv_report.py compile with the triton
package's compiler instead, which need not match jaxlib's.

Needs the deviceless environment of deviceless_step.py, and ptxas replaced there by a wrapper
that keeps what it compiles (a scratch environment only: it moves its ptxas aside):
    /tmp/gv/bin/python benchmarks/experiments/kernel_sass.py --install-ptxas-wrapper
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 /tmp/gv/bin/python \
        benchmarks/experiments/kernel_sass.py silu_mul_fp8 --tokens 512 [--kw '{"num_warps": 8}']

Kernels (8B shapes): attention (a decode bucket, --tokens sequences of 1,536 tokens, --kv-dtype,
--page-size),
silu_mul_fp8 (--n: 2I), fp8_quant (--norm), fp8_quant_residual (--k: H), fp8_gemv (--n, --k,
--norm / --swiglu), int4_gemv (--n, --k), fp8_block_matmul (--tokens, --n, --k; groups of 128).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import re
import shutil
import stat
import tempfile

import jax
import jax.numpy as jnp

_WRAPPER = """#!/bin/bash
# ptxas, keeping each PTX it compiles and the SASS of its cubin under $PTX_DUMP (if set)
out=""; prev=""; src=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; elif [ "${a#-}" = "$a" ]; then src="$a"; fi; prev="$a"
done
if [ -z "$PTX_DUMP" ]; then exec "$(dirname "$0")/ptxas.real" "$@"; fi
mkdir -p "$PTX_DUMP"; n=$(date +%s%N)
[ -n "$src" ] && cp "$src" "$PTX_DUMP/$n.ptx"
"$(dirname "$0")/ptxas.real" -v "$@" 2> "$PTX_DUMP/$n.ptxas.txt"; rc=$?
cat "$PTX_DUMP/$n.ptxas.txt" >&2
[ -n "$out" ] && [ -f "$out" ] && "$(dirname "$0")/cuobjdump" -sass "$out" > "$PTX_DUMP/$n.sass"
exit $rc
"""
_SASS_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")


def install_ptxas_wrapper() -> str:
    """Puts _WRAPPER in place of this environment's ptxas (the CUDA wheels' bin directory),
    which it calls as ptxas.real; cuobjdump comes from pip's nvidia-cuda-cuobjdump."""
    import nvidia

    [bin_dir] = {os.path.dirname(p) for root in nvidia.__path__
                 for p in glob.glob(os.path.join(root, "*", "bin", "ptxas*"))}
    ptxas = os.path.join(bin_dir, "ptxas")
    if not os.path.exists(ptxas + ".real"):
        shutil.move(ptxas, ptxas + ".real")
    with open(ptxas, "w") as f:
        f.write(_WRAPPER)
    os.chmod(ptxas, os.stat(ptxas).st_mode | stat.S_IEXEC)
    if not os.path.exists(os.path.join(bin_dir, "cuobjdump")):
        raise SystemExit("pip install nvidia-cuda-cuobjdump into this environment")
    return ptxas


def sass_report(sass_path: str) -> dict:
    """Instructions of the kernel and of each loop (a backward branch's span), the innermost
    loops' opcodes."""
    ops = []
    for line in open(sass_path):
        m = _SASS_LINE.match(line)
        if m:
            target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", line)
            ops.append((int(m.group(1), 16), m.group(3),
                        int(target.group(1), 16) if target and target.group(1) else None))
    address = {addr: i for i, (addr, _, _) in enumerate(ops)}
    loops = [(address[t], i) for i, (addr, op, t) in enumerate(ops)
             if op == "BRA" and t is not None and t < addr and t in address]
    report = {"instructions": len(ops), "loops": []}
    for start, end in loops:
        mix = collections.Counter(op for _, op, _ in ops[start:end + 1])
        report["loops"].append({"instructions": end - start + 1,
                                "top_opcodes": mix.most_common(12)})
    return report


def kernel_call(a):
    """(fn, abstract args) for the kernel named on the command line, at 8B shapes."""
    sds = jax.ShapeDtypeStruct
    kw = json.loads(a.kw)
    if a.kernel == "attention":
        from pallas_kernels.ragged_paged_attention import ragged_paged_attention
        s, pages = a.tokens, -(-1536 // a.page_size)
        cache = sds((s * pages, 8, a.page_size, 128), jnp.dtype(a.kv_dtype))
        scales = {} if a.kv_dtype == "bfloat16" else dict(k_scale=2.0, v_scale=0.5)
        return functools.partial(ragged_paged_attention, sm_scale=0.088, **scales, **kw), (
            sds((s, 32, 128), jnp.bfloat16), cache, cache, sds((s,), jnp.int32),
            sds((s, pages), jnp.int32), sds((s + 1,), jnp.int32), sds((1,), jnp.int32))
    if a.kernel == "silu_mul_fp8":
        from pallas_kernels.silu_mul_fp8 import silu_mul_fp8
        return functools.partial(silu_mul_fp8, **kw), (
            sds((a.tokens, a.n), jnp.bfloat16), sds((a.tokens,), jnp.float32),
            sds((a.n,), jnp.float32))
    if a.kernel == "fp8_quant":
        from pallas_kernels.fp8_quant import fp8_quant
        norm = (sds((4096,), jnp.bfloat16),) if a.norm else ()
        return functools.partial(fp8_quant, **kw), (sds((a.tokens, 4096), jnp.bfloat16), *norm)
    if a.kernel == "fp8_quant_residual":
        from pallas_kernels.fp8_quant import fp8_quant_residual
        rows = sds((a.tokens, a.k), jnp.bfloat16)
        return functools.partial(fp8_quant_residual, **kw), (
            rows, sds((a.tokens,), jnp.float32), sds((a.k,), jnp.float32), rows,
            sds((a.k,), jnp.bfloat16))
    if a.kernel == "fp8_gemv":
        from pallas_kernels.fp8_gemv import fp8_gemv
        norm = (sds((a.k,), jnp.bfloat16),) if a.norm else ()
        return functools.partial(fp8_gemv, swiglu=a.swiglu, **kw), (
            sds((a.tokens, 2 * a.k if a.swiglu else a.k), jnp.bfloat16),
            sds((a.n, a.k), jnp.float8_e4m3fn), sds((a.n,), jnp.float32), *norm)
    if a.kernel == "int4_gemv":
        from pallas_kernels.int4_gemv import int4_gemv
        return functools.partial(int4_gemv, **kw), (
            sds((a.tokens, a.k), jnp.bfloat16), sds((a.k // 8, a.n), jnp.int32),
            sds((a.k // 128, a.n), jnp.bfloat16), sds((a.k // 128, a.n), jnp.uint8))
    if a.kernel == "fp8_block_matmul":
        from pallas_kernels.fp8_block_matmul import fp8_block_matmul
        groups = a.k // 128
        return functools.partial(fp8_block_matmul, group=128, **kw), (
            sds((a.tokens, a.k), jnp.float8_e4m3fn), sds((a.tokens, groups), jnp.float32),
            sds((a.n, a.k), jnp.float8_e4m3fn), sds((a.n, groups), jnp.float32))
    raise SystemExit(f"unknown kernel {a.kernel}")


def compile_and_report(a) -> dict:
    from jax.experimental.topologies import get_topology_desc

    from deviceless_step import H200_TARGET, as_gpu

    device = get_topology_desc("h200", "cuda", target_config=H200_TARGET,
                               topology="1x1x1").devices[0]
    fn, args = kernel_call(a)
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in args]
    dump = tempfile.mkdtemp(prefix="kernel_sass_")
    os.environ["PTX_DUMP"] = dump
    with as_gpu():
        lowered = jax.jit(fn).lower(*args)
    lowered.compile()
    reports = []
    for sass in sorted(glob.glob(os.path.join(dump, "*.sass"))):
        ptxas = open(sass.replace(".sass", ".ptxas.txt")).read()
        for name, regs in re.findall(r"Function properties for (\w+).*?Used (\d+) registers",
                                     ptxas, re.S):
            spills = re.search(r"(\d+) bytes spill stores", ptxas)
            reports.append({"kernel": name, "registers": int(regs),
                            "spill_store_bytes": int(spills.group(1)) if spills else None,
                            "sass": sass, **sass_report(sass)})
    return {"dump": dump, "kernels": reports}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kernel", nargs="?")
    parser.add_argument("--install-ptxas-wrapper", action="store_true")
    parser.add_argument("--tokens", type=int, default=1, help="rows (attention: sequences)")
    parser.add_argument("--kv-dtype", default="float8_e4m3fn")
    parser.add_argument("--page-size", type=int, default=16, help="attention's block_size")
    parser.add_argument("--n", type=int, default=28672)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--norm", action="store_true")
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--kw", default="{}", help="the kernel's keyword arguments, JSON")
    a = parser.parse_args()
    if a.install_ptxas_wrapper:
        print("wrapper in place:", install_ptxas_wrapper())
        return
    result = compile_and_report(a)
    for k in result["kernels"]:
        mix = lambda loop: " ".join(f"{op} {n}" for op, n in loop["top_opcodes"][:8])  # noqa: E731
        loops = ", ".join(f"{loop['instructions']} ({mix(loop)})" for loop in k["loops"])
        print(f"{k['kernel']}: {k['registers']} registers, {k['spill_store_bytes']} bytes "
              f"spilled, {k['instructions']} instructions; loops: {loops or 'none'}")
    with open(os.path.join(result["dump"], "report.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
