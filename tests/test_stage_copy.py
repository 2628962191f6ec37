"""The step's input staging copy: the kernel (interpret mode) copies every element and no
more, and the step runs it on one GPU only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import h200_mesh, lower_for_h200

from jaxllm.worker.step import staged
from pallas_kernels.stage_copy import BLOCK, stage_copy, stage_copy_reference


@pytest.mark.parametrize("n", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
def test_kernel_copies_every_element(n):
    x = jnp.asarray(np.random.default_rng(n).integers(-2**31, 2**31 - 1, n), jnp.int32)
    got = stage_copy(x, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(stage_copy_reference(x)))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="int32"):
        stage_copy(jnp.zeros((4,), jnp.float32), interpret=True)


def test_the_step_stages_inputs_on_one_gpu_only(monkeypatch):
    """Traced for the GPU: the copy kernel on one device; with a mesh (and on the CPU) the
    packed inputs are read as they came."""
    sds = jax.ShapeDtypeStruct((5000,), jnp.int32)
    x = jnp.arange(4, dtype=jnp.int32)
    assert staged(x) is x  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert 'name = "stage_copy"' in lower_for_h200(lambda x: staged(x) + 1, sds)
    text = lower_for_h200(lambda x: staged(x) + 1, sds, mesh=h200_mesh(tensor=2))
    assert "stage_copy" not in text
