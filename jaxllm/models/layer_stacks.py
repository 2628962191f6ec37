"""A decoder's small per-layer arrays stacked across its layers: one argument buffer each.

A jitted step's dispatch costs the GPU client host time for every argument buffer, and at
batch 1 the host is what a step waits on. The big matrices stay one array a layer; the small
arrays (norm weights, biases, static KV scales, a quantised weight's scales, zero points and
act-order permutation) make up most of a decoder's buffers, so on one device the engine moves
them into params["layer_stacks"]: a key per entry ("attn_norm", or "wqkv.scale" for a field
of a quantised weight) -> [L, ...], the layers' own entries removed (a quantised weight's
field set to None).

The step reads the layers through `layer_views`, which gives back each layer's dict with a
`Row` (the stack and the layer's index) where an entry was stacked. jnp code reads `value(row)`,
a slice that XLA fuses into its consumer; the Pallas kernels read the stack in place at the row
(pallas_kernels/stacked.py), since a slice feeding a kernel would be a copy kernel of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

# Plain entries stacked when every layer holds one of the same shape and dtype; a quantised
# weight's class names its own in STACKED_FIELDS.
STACKED_NAMES = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "bqkv", "bo", "k_scale",
                 "v_scale")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Row:
    """One layer's entry of a stack [L, ...]."""
    stack: jax.Array
    index: int = field(metadata=dict(static=True))

    @property
    def value(self) -> jax.Array:
        return self.stack[self.index]

    @property
    def dtype(self):
        return self.stack.dtype


def value(a):
    """The array an entry stands for: a Row's slice, anything else as it is."""
    return a.value if isinstance(a, Row) else a


def in_place(a) -> tuple[jax.Array, int | None]:
    """(array, layer) for a kernel that reads stacked operands in place: a Row's stack and index,
    else (a, None)."""
    return (a.stack, a.index) if isinstance(a, Row) else (a, None)


def _entries(layer: dict) -> dict[str, jax.Array]:
    """The layer's stackable arrays by key."""
    out = {name: layer[name] for name in STACKED_NAMES if isinstance(layer.get(name), jax.Array)}
    for name, w in layer.items():
        for f in getattr(type(w), "STACKED_FIELDS", ()):
            if getattr(w, f) is not None:
                out[f"{name}.{f}"] = getattr(w, f)
    return out


def stack_layers(params: dict, free_inputs: bool = True) -> dict:
    """params with the entries every layer holds alike (same shape and dtype) stacked into
    params["layer_stacks"] (beside any stacked before); each layer's own copy is deleted
    (free_inputs; not when tracing abstract params). One device only: a stack is placed as
    jnp.stack places it."""
    layers = params["layers"]
    per_layer = [_entries(layer) for layer in layers]
    keys = [key for key, a in per_layer[0].items()
            if len(layers) > 1 and all(key in e and e[key].shape == a.shape
                                       and e[key].dtype == a.dtype for e in per_layer)]
    stacks = {key: jnp.stack([e[key] for e in per_layer]) for key in keys}
    if free_inputs:
        for a in {id(e[key]): e[key] for e in per_layer for key in keys}.values():
            a.delete()
    return {**params, "layers": [_without(layer, keys) for layer in layers],
            "layer_stacks": {**params.get("layer_stacks", {}), **stacks}}


def _without(layer: dict, keys: list[str]) -> dict:
    out = dict(layer)
    for key in keys:
        name, _, f = key.partition(".")
        if f:
            out[name] = dataclasses.replace(out[name], **{f: None})
        else:
            del out[name]
    return out


def layer_views(params: dict) -> list[dict]:
    """Each layer's dict as `forward` reads it: stacked entries back in place as Rows."""
    stacks = params.get("layer_stacks")
    if not stacks:
        return params["layers"]
    views = []
    for index, layer in enumerate(params["layers"]):
        view = dict(layer)
        for key, stack in stacks.items():
            name, _, f = key.partition(".")
            row = Row(stack, index)
            view[name] = dataclasses.replace(view[name], **{f: row}) if f else row
        views.append(view)
    return views
