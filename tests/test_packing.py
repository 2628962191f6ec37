"""The step's packed input buffer: every leaf aligned for kernels that take a slice of it, and the
pytree back intact inside jit."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxllm.worker.batch import SeqChunk, build_step_batch
from jaxllm.worker.packing import ALIGN_BYTES, pack, unpack


def _step_batch(num_tokens: int, num_seqs: int, max_blocks: int):
    chunks = [SeqChunk(list(range(1, 6)), 0, [1, 2]), SeqChunk([7], 20, [3, 4])]
    return build_step_batch(chunks, num_tokens, num_seqs, max_blocks, 16)


def _tree():
    """Leaves of awkward sizes and every packable dtype."""
    rng = np.random.default_rng(0)
    return {"a": rng.integers(-9, 9, 3, dtype=np.int32),
            "b": rng.random((5, 7), dtype=np.float32),
            "c": rng.random(777) < 0.5,
            "d": np.array(True),
            "e": np.arange(2, dtype=np.uint32),
            "f": np.zeros(0, np.int32)}


@pytest.mark.parametrize("num_tokens,num_seqs,max_blocks", [
    (16, 8, 128),  # H200: block tables at 192 bytes before alignment; Mosaic refused them
    (32, 2, 64), (777, 3, 49), (2048, 256, 512)])
def test_every_leaf_starts_256_byte_aligned(num_tokens, num_seqs, max_blocks):
    batch = _step_batch(num_tokens, num_seqs, max_blocks)
    tree = (batch, _tree(), np.zeros(num_seqs + 1, np.int32), np.array(False))
    buf, layout = pack(tree)
    assert len(layout.entries) == len(jax.tree.leaves(tree))
    for offset, _, _ in layout.entries:
        assert (offset * buf.itemsize) % ALIGN_BYTES == 0, layout.entries
    assert (buf.nbytes % ALIGN_BYTES) == 0


def test_unpack_inside_jit_round_trips():
    tree = (_step_batch(48, 8, 9), _tree())
    buf, layout = pack(tree)
    out = jax.jit(unpack, static_argnums=1)(buf, layout)
    for want, got in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
        want = np.asarray(want)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), want)
    assert jax.tree.structure(out) == jax.tree.structure(tree)


def test_layout_depends_only_on_shapes():
    """The layout is the jit's static argument: values must not change it."""
    _, first = pack(_tree())
    other = jax.tree.map(lambda x: np.ones_like(x), _tree())
    assert pack(other)[1] == first


def test_refuses_8_byte_leaves():
    with pytest.raises(TypeError, match="4-byte or bool"):
        pack({"x": np.zeros(3, np.int64)})
