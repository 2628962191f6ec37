"""Putting one host tensor on device(s) in the target dtype, optionally transposed.

`shardings(path) -> Sharding | None` decides where each param goes (None: the default device).
For a NamedSharding the raw [out, in] tensor is placed with the transposed spec, so each device
receives only its own shard and transposes it locally.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

Shardings = Callable[[str], "jax.sharding.Sharding | None"]


@functools.lru_cache(maxsize=None)
def _converter(dtype, transpose: bool, sharding):
    def convert(x):
        return (x.T if transpose else x).astype(dtype)
    return jax.jit(convert, out_shardings=sharding)


def _source_sharding(sharding, transpose: bool):
    if sharding is None or not transpose:
        return sharding
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*reversed(spec)))


def place(host: np.ndarray, dtype, transpose: bool, sharding=None) -> jax.Array:
    """host [out, in] (if transpose) or any shape -> device array in `dtype`."""
    if transpose and sharding is not None and not isinstance(sharding, NamedSharding):
        host, transpose = np.ascontiguousarray(host.T), False
    source = _source_sharding(sharding, transpose)
    if source is None:
        device_array = jax.device_put(host)
    else:  # each device copies only its slice; also when the mesh spans processes (multi-host)
        device_array = jax.make_array_from_callback(host.shape, source, lambda index: host[index])
    return _converter(jnp.dtype(dtype), transpose, sharding)(device_array)
