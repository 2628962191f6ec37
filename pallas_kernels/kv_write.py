"""KV write: this step's new K/V scattered into their cache slots (slot = page * P + offset)."""

from __future__ import annotations

import jax


def write_kv_reference(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
                       slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k_cache, v_cache: [N, P, Hkv, D]; k, v: [T, Hkv, D]; slot_mapping: [T] int32.

    A scatter on the flattened cache; with the cache donated, XLA updates it in place.
    """
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    flat = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache = k_cache.reshape(flat).at[slot_mapping].set(k.astype(k_cache.dtype))
    v_cache = v_cache.reshape(flat).at[slot_mapping].set(v.astype(v_cache.dtype))
    return k_cache.reshape(num_pages, page_size, num_kv_heads, head_dim), v_cache.reshape(
        num_pages, page_size, num_kv_heads, head_dim)
