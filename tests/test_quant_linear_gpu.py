"""benchmarks/quant_linear_gpu.py's timer: its chain keeps every call (a timed run whose calls
XLA dropped would read a fraction of the time)."""

import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_chain_keeps_every_call(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the import appends to it
    import quant_linear_gpu

    x = jnp.ones((1, 256), jnp.float32)
    ws = [jnp.full((256, 384), i, jnp.float32) for i in range(9)]
    compiled = jax.jit(quant_linear_gpu.chain(lambda x, w: x @ w)).lower(x, ws).compile()
    assert len(re.findall(r" dot\(", compiled.as_text())) == len(ws)
    outs = compiled(x, ws)
    assert [float(y[0, 0]) for y in outs] == [256.0 * i for i in range(9)]
