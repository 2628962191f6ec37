"""benchmarks/experiments/pdl_chain_gpu.py: only its Mosaic PDL variant asks for programmatic
dependent launch in its lowering (`uses_pdl`; XLA gives Triton kernels theirs by a flag, at
compilation), every variant lowers for an H200, and the Mosaic GPU kernel's copies and
barriers compute its `reference` (Mosaic GPU's interpreter; the PDL instructions have no CPU
rule and order nothing in a sequential interpreter)."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import lower_for_h200

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "experiments"))
import pdl_chain_gpu  # noqa: E402


@pytest.mark.parametrize("variant", sorted(pdl_chain_gpu.VARIANTS))
def test_only_the_pdl_variant_asks_for_pdl(variant):
    x = jax.ShapeDtypeStruct((2 * pdl_chain_gpu.BLOCK[0], pdl_chain_gpu.BLOCK[1]), jnp.float32)
    text = lower_for_h200(pdl_chain_gpu.VARIANTS[variant], x)
    assert ("uses_pdl" in text) == (variant == "mosaic_pdl")


def test_the_mosaic_kernel_chains_the_closed_form(monkeypatch):
    monkeypatch.setattr(plgpu, "kernel", functools.partial(
        plgpu.kernel, interpret=plgpu.InterpretGPUParams()))
    rows, cols = 3 * pdl_chain_gpu.BLOCK[0], pdl_chain_gpu.BLOCK[1]
    x = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    got = pdl_chain_gpu.mosaic_step(pdl_chain_gpu.mosaic_step(x, pdl=False), pdl=False)
    want = pdl_chain_gpu.reference(pdl_chain_gpu.reference(x))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
