"""benchmarks/experiments/deviceless_step.py's accounting of a compiled program's kernels,
on a program compiled for this CPU (the H200 compile itself needs jax's CUDA plugin): an
in-place update counts its update, a gather its rows, not the arrays they index."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "experiments"))
import deviceless_step  # noqa: E402


def test_kernels_count_what_they_touch_not_what_they_index():
    def program(cache, update, index, table, ids):
        return jax.lax.dynamic_update_slice(cache, update * 2, (index, 0)), table[ids] + 1

    shapes = [((4096, 1024), jnp.float32), ((1, 1024), jnp.float32), ((), jnp.int32),
              ((50000, 256), jnp.float32), ((8,), jnp.int32)]
    compiled = jax.jit(program, donate_argnums=0).lower(
        *(jax.ShapeDtypeStruct(*s) for s in shapes)).compile()
    comps, entry = deviceless_step.parse_computations(compiled.as_text())
    launched = deviceless_step.kernels(comps, entry)
    found = {k["label"].rsplit(":", 1)[-1]: k["bytes"] for k in launched}
    assert found["dynamic_update_slice"] == 2 * 1024 * 4 + 4  # the row in and out, the index
    assert found["add"] == 2 * 8 * 256 * 4 + 8 * 4  # the rows gathered and written, the ids
    summary = deviceless_step.summarize(launched, 1, 10)
    assert summary["kernels"] == 2 and summary["bytes"] == sum(found.values())
