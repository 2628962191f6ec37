"""benchmarks/experiments/pdl_chain_gpu.py: only its PDL variant asks XLA for programmatic
dependent launch, and every variant lowers for an H200."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import lower_for_h200

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "experiments"))
import pdl_chain_gpu  # noqa: E402


@pytest.mark.parametrize("variant", sorted(pdl_chain_gpu.VARIANTS))
def test_only_the_pdl_variant_asks_for_pdl(variant):
    x = jax.ShapeDtypeStruct((2 * pdl_chain_gpu.BLOCK[0], pdl_chain_gpu.BLOCK[1]), jnp.float32)
    text = lower_for_h200(pdl_chain_gpu.VARIANTS[variant], x)
    assert ("uses_pdl" in text) == (variant == "mosaic_pdl")
