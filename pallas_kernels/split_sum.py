"""The sum of a kernel's K-split partial results, [splits, ...] -> [...], written as one add per
split (the split count is static and small). XLA fuses such elementwise adds into each consumer;
a reduction over the split axis it keeps as a kernel of its own, which at one token is a
launch-bound kernel a call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def sum_splits(parts: jax.Array) -> jax.Array:
    """parts [K, ...] -> [...], summed in split order (as jnp.sum(parts, axis=0))."""
    return functools.reduce(jnp.add, (parts[k] for k in range(parts.shape[0])))
