"""Operands stacked across a model's layers: a layer's small arrays (a norm's weight, a quantised
weight's scales) may come as one row of an array [L, ...] that holds every layer's, read in place
at `layer`. A jitted step pays the GPU client per argument buffer at dispatch, so the engine
keeps such arrays stacked; a slice taken outside the kernel would be a copy kernel of its own."""

from __future__ import annotations

import jax


def check_stacked(name: str, array: jax.Array, shape: tuple[int, ...], layer: int | None) -> None:
    """array is `shape`, or [L, *shape] with 0 <= layer < L; ValueError otherwise."""
    if array.shape == shape:
        return
    if array.shape[1:] != shape or layer is None or not 0 <= layer < array.shape[0]:
        raise ValueError(f"{name} {array.shape}: want {list(shape)}, or [L, "
                         f"{', '.join(map(str, shape))}] stacked with 0 <= layer < L "
                         f"(layer {layer})")


def prefix(ref, ndim: int, layer: int | None) -> tuple:
    """Index prefix into a ref of an operand of `ndim` axes: (), or (layer,) when stacked."""
    return () if len(ref.shape) == ndim else (layer,)
