"""A Pallas (Triton) kernel's loop without a dot, its loads streamed through shared memory.

Triton's software pipeliner issues a loop's loads `num_stages - 1` iterations ahead as
asynchronous copies into shared memory (cp.async: LDGSTS, waited on by DEPBAR) only where they
feed a dot, unless the loop itself carries `tt.num_stages`; jax's Pallas lowering puts it on no
loop. So a GEMV's K loop, having no dot, loads each tile into registers when its iteration
comes and waits out the memory's latency, whatever the kernel's `num_stages`. `fori_loop` here
is lax.fori_loop with the attribute: the loop's index passes through `_stages_p`, an identity
whose Triton lowering sets it on the scf.for owning that index. In interpret mode (the CPU) the
mark is the identity and the loop runs as lax.fori_loop's.

jax is pinned (pyproject.toml), so the private lowering registry this adds a rule to does not
move under it; tests/test_pipelined_loop.py checks the attribute on the lowered Triton IR.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering
from jax.extend.core import Primitive
from jax.interpreters import mlir

_stages_p = Primitive("pipeline_stages")
_stages_p.def_impl(lambda index, *, num_stages: index)
_stages_p.def_abstract_eval(lambda index, *, num_stages: index)
mlir.register_lowering(_stages_p, lambda ctx, index, *, num_stages: [index])


@lowering.register_lowering(_stages_p)
def _mark_loop(ctx, index, *, num_stages):
    loop = index.owner.owner.operation if isinstance(index, ir.BlockArgument) else None
    if loop is None or loop.name != "scf.for":
        raise ValueError("pipelined_loop: the index of a loop Pallas lowers to scf.for only")
    loop.attributes["tt.num_stages"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(32), num_stages)
    return index


def fori_loop(lower, upper, body: Callable[[jax.Array, Any], Any], init, *,
              num_stages: int):
    """lax.fori_loop(lower, upper, body, init), its loads `num_stages` deep through shared
    memory on the GPU (1: each loaded when its iteration comes)."""
    if num_stages < 1:
        raise ValueError(f"num_stages {num_stages}: at least 1")
    return jax.lax.fori_loop(
        lower, upper, lambda i, carry: body(_stages_p.bind(i, num_stages=num_stages), carry),
        init)
