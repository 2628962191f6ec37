"""KV cache sizing and allocation: how many blocks fit, and the per-layer page arrays."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxllm.worker import device_memory
from pallas_kernels.kv_write import is_float8
from pallas_kernels.ragged_paged_attention import MAX_1BYTE_CACHE_BYTES

logger = logging.getLogger(__name__)

GiB = 1 << 30
CPU_KV_CACHE_BYTES = 512 * 1024 * 1024  # a CPU has no device memory to measure
# Of jax's pool, kept free whatever the share: XLA's autotuner takes its buffers from the pool
# while warm-up compiles, after the KV cache is allocated; an 8B model's autotuning needs a
# few GB of it. Its buffers are one GEMM's operands and result, so a small model's need less
# than its weights and activations: the floor is capped there, or a small pool (a tiny model
# at a low gpu_memory_utilization) would leave the KV cache nothing.
POOL_HEADROOM = 0.1
MIN_HEADROOM_BYTES = 8 * GiB


def cache_dtype(kv_cache_dtype: str, model_dtype):
    """CacheConfig.kv_cache_dtype -> the pages' dtype ("auto": the model's)."""
    return jnp.dtype(model_dtype if kv_cache_dtype == "auto" else jnp.float8_e4m3fn)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype) -> int:
    """K and V of one block across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def cap_num_blocks(num_blocks: int, num_arrays_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype) -> int:
    """num_blocks, lowered where a 1-byte (float8) page array holding num_arrays_blocks per
    block (the DP ranks' pools share one array) would pass what the Pallas kernels can address
    (MAX_1BYTE_CACHE_BYTES). No limit for wider dtypes (their element offsets stay below 2**31
    up to the 4 GiB where Pallas takes 64-bit ones)."""
    if jnp.dtype(dtype).itemsize != 1:
        return num_blocks
    block_bytes = num_arrays_blocks * block_size * num_kv_heads * head_dim
    return min(num_blocks, MAX_1BYTE_CACHE_BYTES // block_bytes)


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> tuple[int, int, int, int]:
    """[N, Hkv, P, D]: head-major pages, a page's tokens of one KV head contiguous (what one
    attention program reads)."""
    return num_blocks, num_kv_heads, block_size, head_dim


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype, sharding=None) -> list[tuple]:
    """One (k_cache, v_cache) pair per layer, zeros (jnp.empty is uninitialised since jax 0.11),
    a float8 one on a CPU as Float8Bits."""
    shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    as_bits = is_float8(dtype) and jax.default_backend() == "cpu"
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.uint8 if as_bits else dtype),
                    out_shardings=sharding)

    def make():
        return Float8Bits(zeros(), jnp.dtype(dtype)) if as_bits else zeros()
    return [(make(), make()) for _ in range(num_layers)]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Float8Bits:
    """A float8 cache kept as its bits, as caches are on a CPU. There the KV write and the
    attention reference work on a float8 cache's bits (XLA's CPU backend widens whole float8
    arrays), and XLA's CPU backend copies a whole array to bitcast a step's argument or result:
    a step that takes and returns the bits has its bitcasts cancel the kernels' instead."""
    bits: jax.Array  # uint8, the cache's shape
    dtype: jnp.dtype = field(metadata=dict(static=True))


def _is_bits(x) -> bool:
    return isinstance(x, Float8Bits)


def _view(cache):
    return jax.lax.bitcast_convert_type(cache.bits, cache.dtype) if _is_bits(cache) else cache


def _keep(kept, new):
    if not _is_bits(kept):
        return new
    return Float8Bits(jax.lax.bitcast_convert_type(new, jnp.uint8), kept.dtype)


def cache_views(kv_caches: list) -> list:
    """The caches as the model reads them: Float8Bits as their float8 arrays."""
    return jax.tree.map(_view, kv_caches, is_leaf=_is_bits)


def kept_as(new_caches: list, kept: list) -> list:
    """The model's updated caches kept as the step's were: bits again where those were."""
    return jax.tree.map(_keep, kept, new_caches, is_leaf=_is_bits)


def device_memory_limit() -> int | None:
    """The first device's allocator limit in bytes, or None on a CPU (no device memory)."""
    device = jax.devices()[0]
    return None if device.platform == "cpu" else allocator_stats(device)[0]


def allocator_stats(device) -> tuple[int, int]:
    """(limit, in use) bytes of jax's allocator on a GPU. jax's pool reports both. XLA's VMM
    allocator (taken when XLA_FLAGS picks a CUDA-graph update mode other than ALWAYS_UPDATE)
    reports neither, so the driver's figures stand in: it maps up to the pool's share of the
    device, and all the device has in use counts (other processes' memory too)."""
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return stats["bytes_limit"], stats["bytes_in_use"]
    free, total = device_memory.driver_memory_info(device)
    return int(total * device_memory.pool_fraction()), total - free


def live_array_bytes(device) -> int:
    """Bytes that jax's live arrays hold on `device`: a floor under the allocator's count of
    bytes in use, for an allocator whose count falls short of it."""
    return sum(shard.data.nbytes for array in jax.live_arrays()
               for shard in array.addressable_shards if shard.device == device)


@dataclass(frozen=True)
class DeviceMemoryBudget:
    """How the KV cache's share of one device was found (bytes)."""
    gpu_memory_utilization: float
    device: int  # the whole device
    pool: int  # jax's allocator pool, preallocated: gpu_memory_utilization of the device
    in_use: int  # weights and anything else already allocated
    activations: int  # the largest step's profiled temporaries
    headroom: int  # left free in the pool for XLA's autotuner
    kv_cache: int

    def describe(self) -> str:
        gib = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
        return (f"device memory: jax's pool takes {gib(self.pool)} of the {gib(self.device)} "
                f"device ({self.pool / self.device:.2f}; gpu_memory_utilization="
                f"{self.gpu_memory_utilization:g}); of it weights and buffers {gib(self.in_use)}, "
                f"activation peak {gib(self.activations)}, kept free for XLA's autotuner "
                f"{gib(self.headroom)}, KV cache {gib(max(self.kv_cache, 0))}")


def device_memory_available(gpu_memory_utilization: float, activation_peak_bytes: int,
                            device=None) -> int:
    """Bytes the KV cache may take on `device` (default: the first; a DP replica passes its own,
    as the replicas before it have filled theirs), logged with how they were found: the allowed
    share of its memory, less what is in use (weights) and the step's activation peak."""
    device = device or jax.devices()[0]
    limit, in_use = allocator_stats(device)
    held = live_array_bytes(device)
    if held > in_use:
        logger.warning("jax's allocator reports %.2f GiB in use on %s, less than the %.2f GiB its "
                       "live arrays hold: the KV cache is sized from the arrays", in_use / GiB,
                       device, held / GiB)
        in_use = held
    budget = kv_cache_budget(limit, in_use, gpu_memory_utilization, activation_peak_bytes,
                             device_memory.pool_fraction())
    logger.info(budget.describe())
    return budget.kv_cache


def kv_cache_budget(bytes_limit: int, bytes_in_use: int, gpu_memory_utilization: float,
                    activation_peak_bytes: int, allocator_fraction: float) -> DeviceMemoryBudget:
    """gpu_memory_utilization is a share of the whole device, as in vLLM; jax's allocator pool
    (bytes_limit) holds allocator_fraction of it, the same share unless jax started before the
    engine could set it (device_memory.py). The KV cache gets the smaller of the share and the
    pool less its autotuning headroom, less what is in use and the activations."""
    device = int(bytes_limit / allocator_fraction)
    floor = min(MIN_HEADROOM_BYTES, bytes_in_use + activation_peak_bytes)
    headroom = max(int(bytes_limit * POOL_HEADROOM), floor)
    usable = min(int(device * gpu_memory_utilization), bytes_limit - headroom)
    return DeviceMemoryBudget(gpu_memory_utilization, device, bytes_limit, bytes_in_use,
                              activation_peak_bytes, headroom,
                              usable - bytes_in_use - activation_peak_bytes)


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
        f"(or `kv_cache_memory_bytes`, or `num_gpu_blocks_override`) or decreasing `max_model_len` "
        f"when initializing the engine.")
