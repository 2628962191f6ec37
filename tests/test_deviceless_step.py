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


def test_a_kernel_given_a_layer_stack_reads_one_row():
    """A Pallas call's operand from params["layer_stacks"] ([L, ...], read in place at its
    layer, here through a bitcast) counts one row; other operands count whole."""
    hlo = """ENTRY %main (a: bf16[32,8,16], b: bf16[1,16]) -> f32[1,8] {
  %params__layer_stacks____wo_scales__.1 = bf16[32,8,16]{2,1,0} parameter(0)
  %bitcast.7 = bf16[32,128]{1,0} bitcast(%params__layer_stacks____wo_scales__.1)
  %x.1 = bf16[1,16]{1,0} parameter(1)
  ROOT %pallas_call.1 = f32[1,8]{1,0} custom-call(%x.1, %bitcast.7), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/jit(int4_gemv)/pallas_call"}
}"""
    comps, entry = deviceless_step.parse_computations(hlo)
    [kernel] = deviceless_step.kernels(comps, entry)
    assert kernel["label"] == "pallas:int4_gemv"
    assert kernel["bytes"] == 16 * 2 + 8 * 16 * 2 + 8 * 4  # x, one row of the stack, the output
