"""Random weights generated on device, for benchmarks of real shapes without checkpoints."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxllm.loader.hf_names import flatten_paths, unflatten_paths
from jaxllm.loader.placement import Shardings
from jaxllm.models import ModelArgs, param_shapes

_INIT_STD = 0.02
_ONES = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "k_scale", "v_scale")


@functools.lru_cache(maxsize=None)
def _generator(shape: tuple[int, ...], dtype, ones: bool, sharding):
    def generate(key):
        if ones:
            return jnp.ones(shape, dtype)
        return (jax.random.normal(key, shape, jnp.float32) * _INIT_STD).astype(dtype)
    return jax.jit(generate, out_shardings=sharding)


def dummy_params(args: ModelArgs, dtype, seed: int = 0, shardings: Shardings | None = None) -> dict:
    """Normal(0, 0.02) matrices, unit norm weights and KV scales, one key per tensor (fold_in of
    seed)."""
    root = jax.random.key(seed)
    flat = {}
    for i, (path, shape) in enumerate(flatten_paths(param_shapes(args)).items()):
        sharding = shardings(path) if shardings else None
        ones = path.rsplit(".", 1)[-1] in _ONES
        flat[path] = _generator(shape, jnp.dtype(dtype), ones, sharding)(
            jax.random.fold_in(root, i))
    return unflatten_paths(flat, args.num_layers)
