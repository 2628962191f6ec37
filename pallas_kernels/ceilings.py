"""Device ceilings (HBM copy bandwidth, GEMV weight-read rate, matmul rate) and the two timers
every benchmark measures with. Benchmarks divide their bytes and FLOPs by these ceilings, measured
on the device they run on, rather than by datasheet figures.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np


def time_calls(fn, *args, reps: int = 20) -> float:
    """Seconds per call of `fn(*args)`: the best of three batches of `reps` back-to-back launches
    after a warm-up call (compilation). Launches queue ahead of the device, so for calls longer
    than a launch the host's dispatch cost hides."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def time_chain(call, x, *args, donate: bool = False, reps: int = 5,
               min_extra_s: float = 5e-4) -> float:
    """Seconds per `x = call(x, i, *args)` (i: the call's index, for rotating inputs), for calls
    too short for `time_calls`: n and 1 calls unrolled in one jit, each call's output the next
    one's input (nothing can be hoisted or merged), medians of `reps` runs; (t(n) - t(1)) /
    (n - 1) cancels the dispatch. n is 11, or 101 where ten calls take under `min_extra_s` (a
    few microseconds each: the host's jitter would swamp them). NaN when the difference is not
    positive (below the resolution)."""
    def chain(n):
        nonlocal x

        def run(x, *args):
            for i in range(n):
                x = jax.lax.optimization_barrier(call(x, i, *args))
            return x
        fn = jax.jit(run, donate_argnums=(0,) if donate else ())
        x = jax.block_until_ready(fn(x, *args))
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            x = jax.block_until_ready(fn(x, *args))
            times.append(time.perf_counter() - start)
        return float(np.median(times))
    once = chain(1)
    calls = 11
    extra = chain(calls) - once
    if extra < min_extra_s:
        calls = 101
        extra = chain(calls) - once
    return extra / (calls - 1) if extra > 0 else float("nan")


@dataclass
class Ceilings:
    hbm_bytes_per_s: float  # f32 copy bandwidth: (read + write bytes) / time
    gemv_bytes_per_s: float  # weight-read rate of a matrix-vector product (decode's pattern)
    matmul_flops_per_s: float  # large square matmul in the benchmark dtype
    device: str
    dtype: str

    def as_dict(self) -> dict:
        return asdict(self)

    def times(self, num_devices: int) -> "Ceilings":
        """The ceilings of num_devices such devices working together (perfect scaling): the
        floor of an engine over a TP x DP mesh divides its bytes and FLOPs over all of them."""
        if num_devices == 1:
            return self
        return replace(self, hbm_bytes_per_s=self.hbm_bytes_per_s * num_devices,
                       gemv_bytes_per_s=self.gemv_bytes_per_s * num_devices,
                       matmul_flops_per_s=self.matmul_flops_per_s * num_devices,
                       device=f"{num_devices} x {self.device}")


def measure_ceilings(dtype: str = "bfloat16", copy_bytes: int | None = None,
                     matmul_n: int | None = None, reps: int = 20) -> Ceilings:
    """Copy bandwidth, GEMV read rate and matmul rate on the first device (GPU: a 2 GiB copy,
    8192^3 matmul; elsewhere small sizes)."""
    on_gpu = jax.default_backend() == "gpu"
    copy_bytes = copy_bytes or (2 << 30 if on_gpu else 16 << 20)
    matmul_n = matmul_n or (8192 if on_gpu else 512)
    dt = jnp.dtype(dtype)
    # The copy in f32 whatever the dtype: XLA's bf16 elementwise ops run under the f32 rate, so
    # a bf16 copy would understate the bandwidth.
    x = jnp.ones(copy_bytes // 4, jnp.float32)
    copy_s = time_calls(jax.jit(lambda a: a * 1.0001), x, reps=reps)
    del x
    rows = int(math.sqrt(copy_bytes // 4 // dt.itemsize))  # a quarter of the copy size
    w = jax.random.normal(jax.random.key(0), (rows, rows), dt)
    v = jnp.ones((rows,), dt)
    gemv_s = time_calls(jax.jit(lambda a: a @ v), w, reps=reps)
    del w
    a = jax.random.normal(jax.random.key(1), (matmul_n, matmul_n), dt)
    matmul_s = time_calls(jax.jit(lambda m: m @ m), a, reps=reps)
    return Ceilings(hbm_bytes_per_s=2 * copy_bytes / copy_s,
                    gemv_bytes_per_s=rows * rows * dt.itemsize / gemv_s,
                    matmul_flops_per_s=2 * matmul_n ** 3 / matmul_s,
                    device=str(jax.devices()[0].device_kind), dtype=dt.name)
