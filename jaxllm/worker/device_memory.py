"""jax's GPU allocator pool sized from gpu_memory_utilization, as vLLM's knob bounds its process.

jax takes its pool when its GPU backend starts, preallocated, as a share of each device
(XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unless set), and never grows it. So the share must be
set before that: `size_allocator_pool` runs when the engine's arguments are made. The pool then
holds everything the engine allocates (weights, activations, the KV cache, XLA's autotuning
scratch); only the CUDA context and library handles lie outside it. Two engines at 0.4 each fit
one device together.

On one device the engine also picks jax's stream-ordered allocator (cudaMallocAsync, the same
preallocated pool): under XLA's default allocator a step's buffers move between steps, and
updating the step's CUDA graph for them costs the host more than a small batch's step takes on
the device. Its sharing with NCCL across devices is unmeasured, so meshes keep the default.
"""

from __future__ import annotations

import ctypes
import logging
import os

import jax
from jax._src import xla_bridge

logger = logging.getLogger(__name__)

FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_FRACTION = 0.75
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"


def size_allocator_pool(gpu_memory_utilization: float) -> None:
    """Sets the pool to gpu_memory_utilization of each GPU if jax's backend has not started; if
    it has, with another share, says so (the pool cannot change while the process runs)."""
    if xla_bridge.backends_are_initialized():
        _check_started_pool(gpu_memory_utilization)
        return
    wanted = f"{gpu_memory_utilization:g}"
    given = os.environ.get(FRACTION_ENV)
    if given is not None and float(given) != gpu_memory_utilization:
        logger.info("%s=%s from the environment replaced by gpu_memory_utilization=%s",
                    FRACTION_ENV, given, wanted)
    os.environ[FRACTION_ENV] = wanted


def choose_allocator(num_devices: int) -> None:
    """jax's stream-ordered allocator for a one-device engine, unless the environment names
    one or jax's backend has started (its allocator is then fixed)."""
    if num_devices != 1 or ALLOCATOR_ENV in os.environ or xla_bridge.backends_are_initialized():
        return
    os.environ[ALLOCATOR_ENV] = "cuda_async"
    logger.info("%s=cuda_async (one device; set %s=default for XLA's own allocator)",
                ALLOCATOR_ENV, ALLOCATOR_ENV)


def pool_fraction() -> float:
    """The share of each GPU that jax's pool was (or will be) given."""
    return float(os.environ.get(FRACTION_ENV, JAX_DEFAULT_FRACTION))


def _check_started_pool(gpu_memory_utilization: float) -> None:
    started = pool_fraction()
    if jax.default_backend() != "gpu" or abs(started - gpu_memory_utilization) < 1e-6:
        return
    effect = ("the process holds more of each GPU than asked" if started > gpu_memory_utilization
              else "the KV cache is sized within the smaller pool")
    logger.warning(
        "jax's GPU backend started before this engine, with an allocator pool of %.2f of each "
        "GPU (%s; jax's default %.2f when unset), not gpu_memory_utilization=%g: %s. Create the "
        "engine before any other jax computation, or set %s=%g before jax starts.",
        started, FRACTION_ENV, JAX_DEFAULT_FRACTION, gpu_memory_utilization, effect,
        FRACTION_ENV, gpu_memory_utilization)


def driver_memory_info(device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device from the driver: cuMemGetInfo in the device's
    primary context, the one jax's GPU client runs in."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(
            f"cannot read device memory from the CUDA driver ({e}): set `kv_cache_memory_bytes` "
            "(--kv-cache-memory-bytes) or `num_gpu_blocks_override` "
            "(--num-gpu-blocks-override)") from e
    handle, context = ctypes.c_int(), ctypes.c_void_p()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    _cuda_check(cuda.cuInit(0), "cuInit")
    _cuda_check(cuda.cuDeviceGet(ctypes.byref(handle), device.local_hardware_id), "cuDeviceGet")
    _cuda_check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle),
                "cuDevicePrimaryCtxRetain")
    try:
        _cuda_check(cuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            _cuda_check(cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)),
                        "cuMemGetInfo")
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(handle)
    return free.value, total.value


def _cuda_check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")
