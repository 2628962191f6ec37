"""pipelined_loop: a Pallas (Triton) kernel's loop without a dot, marked with tt.num_stages
(which Triton's pipeliner needs before it streams such a loop's loads through shared memory);
in interpret mode the loop is lax.fori_loop's. The GEMVs' loops carry their num_stages."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import pipelined_loop
from pallas_kernels.fp8_gemv import fp8_gemv
from pallas_kernels.int4_gemv import int4_gemv

sds = jax.ShapeDtypeStruct
_STAGES = re.compile(r"\}\s*\{[^}]*tt\.num_stages = (\d+) : i32")  # on an scf.for's close


def row_sums(x, start, *, num_stages, interpret, mark=None, static_start=None):
    """x [R, 16] f32, start [1] int32 -> [16]: x's rows start.. summed by a loop with no dot
    (from static_start instead where given: a scan, not a while loop, until lowered).
    mark: a stand-in for the loop index's mark (the guard's test)."""

    def kernel(x_ref, start_ref, o_ref):
        def step(r, acc):
            r = r if mark is None else mark(r)
            return acc + pltriton.load(x_ref.at[r, jnp.arange(16)])

        first = start_ref[0] if static_start is None else static_start
        o_ref[...] = pipelined_loop.fori_loop(first, x_ref.shape[0], step,
                                              jnp.zeros(16, jnp.float32),
                                              num_stages=num_stages)

    return pl.pallas_call(kernel, out_shape=sds((16,), jnp.float32), interpret=interpret,
                          compiler_params=pltriton.CompilerParams(num_warps=1,
                                                                  num_stages=num_stages),
                          )(x, start)


def lowered_stages(fn, *args) -> list[int]:
    modules = []
    lower_for_h200(fn, *args, triton_modules=modules)
    return [int(n) for text in modules for n in _STAGES.findall(text)]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("start,num_stages", [(0, 1), (3, 3), (9, 2), (11, 4)])
def test_the_loop_runs_its_range_in_interpret_mode(start, num_stages, static):
    x = np.random.default_rng(start).standard_normal((11, 16)).astype(np.float32)
    got = row_sums(jnp.asarray(x), jnp.asarray([start], jnp.int32), num_stages=num_stages,
                   interpret=True, static_start=start if static else None)
    np.testing.assert_allclose(got, x[start:].sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("static_start", [None, 2])
@pytest.mark.parametrize("num_stages", [1, 3])
def test_the_loop_carries_its_stages_in_the_triton_ir(num_stages, static_start):
    fn = functools.partial(row_sums, num_stages=num_stages, interpret=False,
                           static_start=static_start)
    assert lowered_stages(fn, sds((11, 16), jnp.float32), sds((1,), jnp.int32)) == [num_stages]


def while_sums(x):
    """x [R, 16] -> [16]: rows 0, 2, 4, ... summed by a while loop (no scf.for: its condition
    is not an index's bound), its index marked."""

    def kernel(x_ref, o_ref):
        def body(carry):
            r, acc = carry
            r = pipelined_loop._stages_p.bind(r, num_stages=2)
            return r + 2, acc + pltriton.load(x_ref.at[r, jnp.arange(16)])

        o_ref[...] = jax.lax.while_loop(lambda c: c[0] * 2 < 2 * x_ref.shape[0], body,
                                        (jnp.int32(0), jnp.zeros(16, jnp.float32)))[1]

    return pl.pallas_call(kernel, out_shape=sds((16,), jnp.float32))(x)


def test_a_mark_on_anything_but_a_for_loops_index_is_refused():
    def mark(r):  # on r + 1: not the loop's own index
        return pipelined_loop._stages_p.bind(r + 1, num_stages=2) - 1

    fn = functools.partial(row_sums, num_stages=2, interpret=False, mark=mark)
    with pytest.raises(ValueError, match="scf.for"):
        lower_for_h200(fn, sds((11, 16), jnp.float32), sds((1,), jnp.int32))
    with pytest.raises(ValueError, match="scf.for"):
        lower_for_h200(while_sums, sds((11, 16), jnp.float32))


def test_fewer_than_one_stage_is_refused():
    with pytest.raises(ValueError, match="num_stages 0"):
        row_sums(jnp.zeros((4, 16)), jnp.zeros(1, jnp.int32), num_stages=0, interpret=True)


@pytest.mark.parametrize("num_stages", [None, 3])
def test_the_gemvs_k_loops_carry_their_stages(num_stages):
    """Their K loops, and no other loop of theirs; 1 (loaded as each step comes) by default."""
    kw = {} if num_stages is None else dict(num_stages=num_stages)
    want = [num_stages or 1]
    k, n = 4096, 4096
    assert lowered_stages(functools.partial(int4_gemv, **kw), sds((1, k), jnp.bfloat16),
                          sds((k // 8, n), jnp.int32), sds((k // 128, n), jnp.bfloat16),
                          sds((k // 128, n), jnp.uint8)) == want
    assert lowered_stages(functools.partial(fp8_gemv, **kw), sds((1, k), jnp.bfloat16),
                          sds((n, k), jnp.float8_e4m3fn), sds((n,), jnp.float32)) == want
