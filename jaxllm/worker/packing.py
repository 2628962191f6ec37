"""One host-to-device transfer per step: the step's small numpy inputs packed into one int32 buffer.

Passing ~20 small numpy arrays to a jitted step costs one transfer each; on an H200 these
measured ~3 ms of host-to-device copies and callbacks per decode step, as much as the 8B model's
weight reads. Packed, they cross in one copy and are sliced apart inside the step for free.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class PackLayout:
    """Static (hashable) description of a packed pytree: a jit static argument."""
    treedef: jax.tree_util.PyTreeDef
    entries: tuple[tuple[int, tuple[int, ...], str], ...]  # (offset, shape, dtype) per leaf


def pack(tree) -> tuple[np.ndarray, PackLayout]:
    """Every leaf must be a 4-byte or bool numpy array (or a numpy scalar)."""
    leaves, treedef = jax.tree.flatten(tree)
    entries, offset = [], 0
    for leaf in leaves:
        leaf = np.asarray(leaf)
        if leaf.dtype != bool and leaf.dtype.itemsize != 4:
            raise TypeError(f"pack takes 4-byte or bool arrays, got {leaf.dtype}")
        entries.append((offset, leaf.shape, leaf.dtype.str))
        offset += leaf.size
    buf = np.empty(offset, np.int32)
    for leaf, (start, shape, dtype) in zip(leaves, entries):
        leaf = np.asarray(leaf)
        flat = leaf.astype(np.int32) if leaf.dtype == bool else leaf
        buf[start:start + leaf.size] = flat.reshape(-1).view(np.int32)
    return buf, PackLayout(treedef, tuple(entries))


def unpack(buf: jax.Array, layout: PackLayout):
    """Inside jit: the pytree back, each leaf with its original shape and dtype."""
    leaves = []
    for start, shape, dtype in layout.entries:
        size = int(np.prod(shape, dtype=np.int64))
        flat = jax.lax.slice_in_dim(buf, start, start + size)
        dtype = np.dtype(dtype)
        if dtype == bool:
            leaf = flat != 0
        elif dtype == np.int32:
            leaf = flat
        else:
            leaf = jax.lax.bitcast_convert_type(flat, jnp.dtype(dtype))
        leaves.append(leaf.reshape(shape))
    return jax.tree.unflatten(layout.treedef, leaves)
