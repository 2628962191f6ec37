"""One GPU call, ~1 minute: what a launch costs inside one jitted step, by kernel kind, and
whether programmatic dependent launch (PDL) takes it away. A batch-1 decode step is ~310
kernels, ~190 of them Pallas (Triton) kernels (docs/lab/2026-12-06-session36.md: their kernels
fill the step; what PDL saves at each boundary is what this measures).

In jax 0.11.2 XLA's `--xla_gpu_enable_pdl` (on by default) puts a `griddepcontrol.wait` at
the start of every kernel it compiles through Triton, Pallas Triton kernels included (their
PTX, deviceless); a Mosaic GPU kernel asks for PDL by calling `plgpu.griddepcontrol_wait` (the
lowering marks it `mosaic_gpu.uses_pdl`). Run it with that flag on and off: whether the Triton
chain's launches then overlap is what the difference shows. XLA puts a chain of Triton kernels
into one command buffer (a CUDA graph) and leaves a chain of Mosaic GPU kernels out of it
(their thunks stay custom calls), so the Mosaic rows also show a launch from the host against
one from a graph. Each variant below chains CHAIN dependent calls of one tiny
kernel (`reference`: 3 - x, 4 x 256 f32 a program) in one jit:

  triton        the Pallas Triton kernel
  triton_trigger  the same, letting its dependents launch first thing (the instruction as
                inline assembly); XLA has put the wait at its start
  mosaic        the Pallas Mosaic GPU kernel: copy in with TMA, compute, copy out
  mosaic_pdl    the same, waiting for its predecessor (griddepcontrol.wait) before its first
                read and letting its dependents launch (griddepcontrol.launch_dependents)
  xla           XLA's own fusions, kept apart by optimization barriers

and reports us a kernel (the chain's wall / CHAIN, the median of REPEATS calls) and checks the
result: on integers 3 - x is exact, so an even chain gives x back bit for bit.

    python benchmarks/experiments/pdl_chain_gpu.py --out DIR [--cpu]   (--cpu: lowering only)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

BLOCK = (4, 256)  # f32 elements a program (TMA copies at most 256 along a dimension)
CHAIN = 256  # even: the chain is the identity
REPEATS = 20
TRIGGER = "griddepcontrol.launch_dependents"


def reference(x):
    """One kernel's work."""
    return 3.0 - x


def triton_step(x: jax.Array, trigger: bool) -> jax.Array:
    def body(x_ref, o_ref):
        v = x_ref[...]
        if trigger:  # dependents may launch now (the instruction, and v passed through)
            v, = pltriton.elementwise_inline_asm(
                f"{TRIGGER}; mov.b32 $0, $1;", args=[v], constraints="=r,r", pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, v.dtype)])
        o_ref[...] = reference(v)

    return pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // BLOCK[0],),
        in_specs=[pl.BlockSpec(BLOCK, lambda i: (i, 0))],
        out_specs=pl.BlockSpec(BLOCK, lambda i: (i, 0)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="chain_triton_trigger" if trigger else "chain_triton")(x)


def mosaic_step(x: jax.Array, pdl: bool) -> jax.Array:
    def body(x_gmem, o_gmem, smem, loaded):
        if pdl:  # dependents may launch now; they wait in their griddepcontrol.wait
            plgpu.griddepcontrol_launch_dependents()
            plgpu.griddepcontrol_wait()  # the predecessor's writes are visible after this
        rows = pl.ds(jax.lax.axis_index("block") * BLOCK[0], BLOCK[0])
        plgpu.copy_gmem_to_smem(x_gmem.at[rows], smem, loaded)
        plgpu.barrier_wait(loaded)
        smem[...] = reference(smem[...])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_gmem.at[rows])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_types=[plgpu.SMEM(BLOCK, x.dtype), plgpu.Barrier(num_arrivals=1)],
        grid=(x.shape[0] // BLOCK[0],), grid_names=("block",),
        kernel_name="chain_mosaic_pdl" if pdl else "chain_mosaic")(x)


def xla_step(x: jax.Array) -> jax.Array:
    return jax.lax.optimization_barrier(reference(x))


VARIANTS = {"triton": functools.partial(triton_step, trigger=False),
            "triton_trigger": functools.partial(triton_step, trigger=True),
            "mosaic": functools.partial(mosaic_step, pdl=False),
            "mosaic_pdl": functools.partial(mosaic_step, pdl=True), "xla": xla_step}


def chain(step, x):
    for _ in range(CHAIN):
        x = step(x)
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="lower for an H200, run nothing")
    parser.add_argument("--blocks", type=int, default=132, help="programs a kernel")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    shape = (cli.blocks * BLOCK[0], BLOCK[1])
    rows = []
    for name, step in VARIANTS.items():
        fn = jax.jit(functools.partial(chain, step))
        if cli.cpu:
            from deviceless_step import as_gpu  # an abstract H200 for the Pallas lowerings
            with as_gpu():
                text = fn.trace(jax.ShapeDtypeStruct(shape, jnp.float32)).lower(
                    lowering_platforms=("cuda",)).as_text()
            row = dict(variant=name, lowered_chars=len(text), uses_pdl="uses_pdl" in text)
        else:
            x = (jnp.arange(math.prod(shape), dtype=jnp.float32) % 1000).reshape(shape)
            got = fn(x).block_until_ready()
            walls = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                fn(x).block_until_ready()
                walls.append(time.perf_counter() - start)
            row = dict(variant=name, blocks=cli.blocks, chain=CHAIN,
                       us_per_kernel=round(float(np.median(walls)) / CHAIN * 1e6, 2),
                       exact=bool(np.array_equal(np.asarray(got), np.asarray(x))))
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(cli.out, "pdl_chain.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
