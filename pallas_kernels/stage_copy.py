"""A copy that XLA can neither fuse nor elide: a step's packed inputs moved into the step's own
temporary buffer before anything reads them.

Why: under XLA's command buffers (CUDA graphs) a run re-records every command that reads an
allocation whose address changed since the last run. A step's packed inputs arrive in a new
buffer each step and their slices are fused into kernels all through the model (positions,
slot mappings and block tables in every layer), so nearly the whole graph was re-recorded, on
the host, every step. Read from the temporary buffer (its address holds from run to run), only
this kernel refers to the new one. XLA would drop or fuse a copy of its own (a copy, a slice, an
optimisation barrier); a custom call it keeps.

  x [N] int32 -> [N] int32, the same values
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BLOCK = 1024  # elements a program


def _kernel(x_ref, o_ref):
    i = pl.program_id(0) * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
    live = i < x_ref.shape[0]
    pltriton.store(o_ref.at[i], pltriton.load(x_ref.at[i], mask=live), mask=live)


@functools.partial(jax.jit, static_argnames=("interpret",))
def stage_copy(x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """The Pallas (Triton) kernel: x [N] int32 copied, in programs of BLOCK elements."""
    if x.ndim != 1 or x.dtype != jnp.int32:
        raise ValueError(f"x {x.shape} {x.dtype}: want [N] int32")
    return pl.pallas_call(
        _kernel, grid=(pl.cdiv(x.shape[0], BLOCK),),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="stage_copy")(x)


def stage_copy_reference(x: jax.Array) -> jax.Array:
    """The contract: the same values."""
    return x
