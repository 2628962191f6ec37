"""KV cache sizing and allocation: how many blocks fit, and the per-layer page arrays."""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

GiB = 1 << 30
# The share of a GPU jax's allocator takes when it starts: jax's default 0.75, which
# jaxllm/__init__.py raises before jax starts.
ALLOCATOR_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_ALLOCATOR_FRACTION = 0.75
POOL_HEADROOM = 0.1


def cache_dtype(kv_cache_dtype: str, model_dtype):
    """CacheConfig.kv_cache_dtype -> the pages' dtype ("auto": the model's)."""
    return jnp.dtype(model_dtype if kv_cache_dtype == "auto" else jnp.float8_e4m3fn)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype) -> int:
    """K and V of one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype, sharding=None) -> list[tuple[jax.Array, jax.Array]]:
    """One (k_cache, v_cache) pair per layer, zeros (jnp.empty is uninitialised since jax 0.11)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)  # [N, P, Hkv, D]
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(make(), make()) for _ in range(num_layers)]


def device_memory_limit() -> int | None:
    """The first device's allocator limit in bytes, or None where memory is not measurable (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return stats.get("bytes_limit") if stats else None


def device_memory_available(gpu_memory_utilization: float, activation_peak_bytes: int) -> int:
    """Bytes the KV cache may take on the first device: the allowed share of its memory, less
    what is in use (weights) and the step's profiled activation peak."""
    stats = jax.devices()[0].memory_stats()
    fraction = float(os.environ.get(ALLOCATOR_FRACTION_ENV, JAX_DEFAULT_ALLOCATOR_FRACTION))
    return kv_cache_budget(stats["bytes_limit"], stats["bytes_in_use"], gpu_memory_utilization,
                           activation_peak_bytes, fraction)


def kv_cache_budget(bytes_limit: int, bytes_in_use: int, gpu_memory_utilization: float,
                    activation_peak_bytes: int, allocator_fraction: float) -> int:
    """gpu_memory_utilization is a share of the whole device, as in vLLM; jax's allocator holds
    allocator_fraction of it (bytes_limit). POOL_HEADROOM of that pool stays free whatever the
    share: XLA's autotuner takes its buffers from the pool while warm-up compiles, after the KV
    cache is allocated (on an H200, leaving 2.8 GB of the pool free ran out of memory there)."""
    budget = min(int(bytes_limit / allocator_fraction * gpu_memory_utilization),
                 int(bytes_limit * (1 - POOL_HEADROOM)))
    return budget - bytes_in_use - activation_peak_bytes


def check_fits(num_blocks: int, block_size: int, max_model_len: int, block_bytes: int) -> None:
    """Raises vLLM's start-up error when one sequence of max_model_len tokens cannot fit."""
    usable_blocks = num_blocks - 1  # block 0 is reserved for padding
    needed_blocks = -(-max_model_len // block_size)
    if usable_blocks >= needed_blocks:
        return
    needed = needed_blocks * block_bytes / GiB
    available = max(usable_blocks, 0) * block_bytes / GiB
    estimated_max_len = max(usable_blocks, 0) * block_size
    raise ValueError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"{needed:.3f} GiB KV cache is needed, which is larger than the available KV cache "
        f"memory ({available:.3f} GiB). Based on the available memory, the estimated maximum "
        f"model length is {estimated_max_len}. Try increasing `gpu_memory_utilization` "
        f"(or `num_gpu_blocks_override`, or the CPU KV budget) or decreasing `max_model_len` "
        f"when initializing the engine.")
