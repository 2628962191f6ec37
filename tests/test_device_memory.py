"""gpu_memory_utilization bounds the device memory the process takes: jax's pool is sized from
it before jax's backend starts, and the KV cache is sized within it. Device memory is mocked."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from jaxllm.engine.args import EngineArgs
from jaxllm.worker import device_memory, kv_cache

GIB = 1 << 30


def test_kv_cache_fills_the_pool_less_weights_activations_and_headroom():
    # pool = 0.4 of a 100 GiB device; 8 GiB (the floor) stays free for the autotuner
    budget = kv_cache.kv_cache_budget(40 * GIB, 16 * GIB, 0.4, 2 * GIB, 0.4)
    assert (budget.device, budget.pool, budget.headroom) == (100 * GIB, 40 * GIB, 8 * GIB)
    assert budget.kv_cache == 14 * GIB
    # a large pool keeps a tenth free
    budget = kv_cache.kv_cache_budget(90 * GIB, 16 * GIB, 0.9, 2 * GIB, 0.9)
    assert budget.headroom == 9 * GIB and budget.kv_cache == 63 * GIB


def test_a_small_model_in_a_small_pool_keeps_a_tenth_free():
    """A tiny model at gpu_memory_utilization 0.1 of an 80 GiB device: the 8 GiB floor would
    take the whole pool; the floor is capped at the weights and activations (the autotuner's
    buffers are one GEMM's operands and result)."""
    budget = kv_cache.kv_cache_budget(8 * GIB, GIB // 8, 0.1, GIB // 8, 0.1)
    assert budget.headroom == int(0.8 * GIB)
    assert budget.kv_cache == 8 * GIB - int(0.8 * GIB) - GIB // 4


def test_a_pool_started_larger_than_asked_still_bounds_the_kv_cache_to_the_share():
    """jax started first with its default 0.75: the engine still uses only 0.4 of the device."""
    budget = kv_cache.kv_cache_budget(75 * GIB, 16 * GIB, 0.4, 2 * GIB, 0.75)
    assert budget.kv_cache == 40 * GIB - 18 * GIB


def test_a_pool_started_smaller_than_asked_bounds_the_kv_cache_to_the_pool():
    budget = kv_cache.kv_cache_budget(75 * GIB, 16 * GIB, 0.9, 2 * GIB, 0.75)
    assert budget.kv_cache == 75 * GIB - 8 * GIB - 18 * GIB  # the headroom floor: 8 > 7.5


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_memory_available_logs_what_was_taken_and_why(monkeypatch, caplog):
    device = _Device({"bytes_limit": 57 * GIB, "bytes_in_use": 15 * GIB})
    monkeypatch.setattr(kv_cache.jax, "devices", lambda: [device])
    monkeypatch.setenv(device_memory.FRACTION_ENV, "0.4")
    with caplog.at_level(logging.INFO, logger=kv_cache.__name__):
        available = kv_cache.device_memory_available(0.4, 1 * GIB)
    assert available == 57 * GIB - 8 * GIB - 16 * GIB
    [message] = [r.getMessage() for r in caplog.records]
    assert "jax's pool takes 57.00 GiB of the 142.50 GiB device (0.40" in message
    assert "gpu_memory_utilization=0.4" in message and "weights and buffers 15.00 GiB" in message
    assert f"KV cache {available / GIB:.2f} GiB" in message


def test_an_allocator_count_below_the_live_arrays_gives_way_to_them(monkeypatch, caplog):
    """The KV cache is sized from what the live arrays hold on the device where the allocator
    reports less in use, with a warning naming both."""
    device = _Device({"bytes_limit": 57 * GIB, "bytes_in_use": 15 * GIB})
    monkeypatch.setattr(kv_cache.jax, "devices", lambda: [device])
    monkeypatch.setenv(device_memory.FRACTION_ENV, "0.4")
    held = {device: 20 * GIB}
    monkeypatch.setattr(kv_cache, "live_array_bytes", lambda d: held.get(d, 0))
    with caplog.at_level(logging.INFO, logger=kv_cache.__name__):
        available = kv_cache.device_memory_available(0.4, 1 * GIB)
    assert available == 57 * GIB - 8 * GIB - 21 * GIB
    assert "reports 15.00 GiB in use" in caplog.text and "live arrays hold: the" in caplog.text
    assert "weights and buffers 20.00 GiB" in caplog.text
    held[device] = 10 * GIB  # the allocator's count stands where it is the larger
    assert kv_cache.device_memory_available(0.4, 1 * GIB) == 57 * GIB - 8 * GIB - 16 * GIB


def test_live_array_bytes_count_each_array_s_shard_on_the_device():
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    before = kv_cache.live_array_bytes(device)
    arrays = [jnp.ones((1000, 3), jnp.float32), jnp.ones((77,), jnp.bfloat16)]
    assert kv_cache.live_array_bytes(device) - before == 12000 + 154
    arrays[0].delete()
    assert kv_cache.live_array_bytes(device) - before == 154
    assert kv_cache.live_array_bytes(object()) == 0


def test_pool_set_from_the_share_before_the_backend_starts(monkeypatch, caplog):
    monkeypatch.setattr(device_memory.xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.delenv(device_memory.FRACTION_ENV, raising=False)
    device_memory.size_allocator_pool(0.4)
    assert os.environ[device_memory.FRACTION_ENV] == "0.4"
    assert device_memory.pool_fraction() == 0.4
    with caplog.at_level(logging.INFO, logger=device_memory.__name__):
        device_memory.size_allocator_pool(0.3)  # the user's (or an earlier) value is replaced
    assert os.environ[device_memory.FRACTION_ENV] == "0.3"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 from the environment replaced" in caplog.text


@pytest.mark.parametrize("num_devices,given,started,chosen", [
    (1, None, False, "cuda_async"), (2, None, False, None), (8, None, False, None),
    (1, "bfc", False, "bfc"), (1, None, True, None)])
def test_one_device_gets_the_stream_ordered_allocator_unless_told_otherwise(
        monkeypatch, num_devices, given, started, chosen):
    monkeypatch.setattr(device_memory.xla_bridge, "backends_are_initialized", lambda: started)
    environ = {} if given is None else {device_memory.ALLOCATOR_ENV: given}
    monkeypatch.setattr(device_memory.os, "environ", environ)
    device_memory.choose_allocator(num_devices)
    assert environ.get(device_memory.ALLOCATOR_ENV) == chosen


@pytest.mark.parametrize("parallel,devices", [
    ({}, 1), ({"tensor_parallel_size": 2}, 2), ({"data_parallel_size": 2}, 2),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4)])
def test_engine_args_choose_the_allocator_for_their_device_count(
        monkeypatch, tiny_llama_dir, parallel, devices):
    asked = []
    monkeypatch.setattr(device_memory, "choose_allocator", asked.append)
    EngineArgs(model=tiny_llama_dir, **parallel).create_engine_config()
    assert asked == [devices]


@pytest.mark.parametrize("started,backend,warns", [
    ("0.75", "gpu", "the process holds more of each GPU than asked"),
    ("0.2", "gpu", "the KV cache is sized within the smaller pool"),
    ("0.4", "gpu", None), ("0.75", "cpu", None)])
def test_a_started_backend_with_another_pool_is_reported_with_the_fix(
        monkeypatch, caplog, started, backend, warns):
    monkeypatch.setattr(device_memory.xla_bridge, "backends_are_initialized", lambda: True)
    monkeypatch.setattr(device_memory.jax, "default_backend", lambda: backend)
    monkeypatch.setenv(device_memory.FRACTION_ENV, started)
    with caplog.at_level(logging.WARNING, logger=device_memory.__name__):
        device_memory.size_allocator_pool(0.4)
    assert os.environ[device_memory.FRACTION_ENV] == started  # too late to change
    if warns is None:
        assert not caplog.records
    else:
        assert warns in caplog.text
        assert "set XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 before jax starts" in caplog.text


def test_importing_jaxllm_leaves_the_pool_to_the_engine():
    """`import jaxllm` no longer fixes jax's pool; a fresh process sees the share it is given."""
    script = textwrap.dedent("""
        import os, jaxllm
        from jaxllm.worker import device_memory
        assert device_memory.FRACTION_ENV not in os.environ, os.environ[device_memory.FRACTION_ENV]
        device_memory.size_allocator_pool(0.25)
        import jax; jax.devices()
        device_memory.size_allocator_pool(0.25)  # started with it: nothing to say
        print(os.environ[device_memory.FRACTION_ENV])
    """)
    env = {k: v for k, v in os.environ.items() if k != device_memory.FRACTION_ENV}
    out = subprocess.run([sys.executable, "-c", script], env=dict(env, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0.25"


def test_a_dp_replica_sizes_its_kv_cache_on_its_own_device(monkeypatch):
    """DP replicas are built one after another: the first has filled device 0 when the second
    measures, so each must read its own device (an H200 pair started DP=2 with 0.002 GiB)."""
    full = _Device({"bytes_limit": 57 * GIB, "bytes_in_use": 56 * GIB})
    free = _Device({"bytes_limit": 57 * GIB, "bytes_in_use": 15 * GIB})
    monkeypatch.setattr(kv_cache.jax, "devices", lambda: [full, free])
    monkeypatch.setenv(device_memory.FRACTION_ENV, "0.4")
    assert kv_cache.device_memory_available(0.4, 1 * GIB, free) == 57 * GIB - 8 * GIB - 16 * GIB
    assert kv_cache.device_memory_available(0.4, 1 * GIB) < 0


def test_a_float8_page_array_is_capped_below_what_the_kernels_address():
    """An 8B layer's float8 K array (16-token blocks, 8 heads x 128) holds at most 2 GiB: 2**31
    / 16 KiB blocks; the DP ranks' pools share it; bf16 pages are not capped."""
    fp8, bf16 = "float8_e4m3fn", "bfloat16"
    assert kv_cache.cap_num_blocks(10**6, 1, 16, 8, 128, fp8) == 2**31 // 2**14 == 131072
    assert kv_cache.cap_num_blocks(10**6, 2, 16, 8, 128, fp8) == 65536
    assert kv_cache.cap_num_blocks(1000, 1, 16, 8, 128, fp8) == 1000
    assert kv_cache.cap_num_blocks(10**6, 1, 16, 8, 128, bf16) == 10**6
    blocks = kv_cache.cap_num_blocks(10**6, 1, 32, 2, 64, fp8)
    assert blocks * 32 * 2 * 64 <= 2**31 < (blocks + 1) * 32 * 2 * 64


class _VmmDevice(_Device):
    """A GPU under XLA's VMM allocator: memory_stats reports nothing (an H200's was {})."""
    platform = "gpu"
    local_hardware_id = 0

    def __init__(self):
        super().__init__({})


def test_under_the_vmm_allocator_the_driver_s_figures_size_the_cache(monkeypatch):
    """The pool's share of the device from the driver's total; all the device has in use
    counts (the driver cannot tell this process's memory from another's)."""
    monkeypatch.setattr(kv_cache.device_memory, "driver_memory_info",
                        lambda device: (100 * GIB, 140 * GIB))
    monkeypatch.setenv(device_memory.FRACTION_ENV, "0.9")
    device = _VmmDevice()
    assert kv_cache.allocator_stats(device) == (126 * GIB, 40 * GIB)
    monkeypatch.setattr(kv_cache.jax, "devices", lambda: [device])
    assert kv_cache.device_memory_limit() == 126 * GIB
    # 0.9 of 140 GiB, less the pool's tenth kept free, the 40 GiB in use and 2 GiB activations
    assert kv_cache.device_memory_available(0.9, 2 * GIB) == 126 * GIB - int(12.6 * GIB) - 42 * GIB


def test_a_cpu_has_no_device_memory_limit():
    assert kv_cache.device_memory_limit() is None


def test_without_a_cuda_driver_the_error_names_the_overrides():
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(RuntimeError, match="num_gpu_blocks_override"):
            device_memory.driver_memory_info(_VmmDevice())
    else:
        pytest.skip("this machine has a CUDA driver")
