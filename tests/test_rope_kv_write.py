"""The fused rope + KV write candidate (benchmarks/experiments/rope_kv_write.py): its reference
against the product's own ops (models/layers.py's rope, kv_write's scatter), the kernel in
interpret mode against the reference on random shapes, ragged token counts, permuted slots and
poisoned caches (within a rounding of the rotated rows: XLA may contract the rope's products into
FMAs in one and not the other), and its CUDA lowering."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import lower_for_h200

from jaxllm.models.args import ModelArgs
from jaxllm.models.layers import apply_rope, rope_cos_sin
from pallas_kernels.kv_write import write_kv_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "rope_kv_write", os.path.join(ROOT, "benchmarks", "experiments", "rope_kv_write.py"))
fused = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fused)


def step(seed, num_tokens, num_kv_heads, group, head_dim, dtype=jnp.bfloat16,
         cache_dtype=None, num_pages=9, page_size=16):
    """Random qkv and positions, caches full of random values (the poison a missed or stray
    write would leave), distinct permuted slots; padding tokens (the last two) write block 0."""
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(3 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache, v_cache = (normal(*cache_shape).astype(cache_dtype or dtype) for _ in range(2))
    qkv = normal(num_tokens, num_kv_heads, group + 2, head_dim).astype(dtype)
    live = max(1, num_tokens - 2)
    slots = np.zeros(num_tokens, np.int32)
    slots[:live] = rng.permutation(np.arange(page_size, num_pages * page_size))[:live]
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=64,
                     hidden_size=head_dim * num_kv_heads * group, intermediate_size=64,
                     num_layers=1, num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, rms_norm_eps=1e-6, max_position_embeddings=4096)
    cos, sin = rope_cos_sin(jnp.asarray(rng.integers(0, 4000, num_tokens), jnp.int32), args)
    return qkv, cos, sin, k_cache, v_cache, jnp.asarray(slots)


def assert_same(got, want):
    """q, then the caches past block 0 (the padding block, which the padding tokens all write:
    any of their rows may land), to one rounding of the model dtype."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if i:
            g, w = g[1:], w[1:]
        np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=2 ** -7 * np.abs(w).max())


def test_reference_is_the_products_rope_and_write():
    qkv, cos, sin, k_cache, v_cache, slots = step(0, 7, 2, 4, 64)
    q, k, v = qkv[:, :, :4], qkv[:, :, 4], qkv[:, :, 5]
    want_q = apply_rope(q.reshape(7, 8, 64), cos, sin).reshape(q.shape)
    want_caches = write_kv_reference(k_cache, v_cache, apply_rope(k, cos, sin), v, slots)
    got = fused.rope_kv_write_reference(qkv, cos, sin, k_cache, v_cache, slots)
    for g, w in zip(got, (want_q, *want_caches)):  # the same ops: bit-equal
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert not np.array_equal(np.asarray(got[0], np.float32), np.asarray(q, np.float32))


@pytest.mark.parametrize("num_tokens, num_kv_heads, group, head_dim, dtype, cache_dtype, scale", [
    (1, 8, 4, 128, jnp.bfloat16, None, 1.0),
    (37, 3, 1, 64, jnp.bfloat16, None, 1.0),
    (16, 2, 8, 64, jnp.float32, None, 1.0),
    (5, 1, 2, 128, jnp.float16, jnp.float8_e4m3fn, 2.0),
])
def test_kernel_matches_reference(num_tokens, num_kv_heads, group, head_dim, dtype, cache_dtype,
                                  scale):
    args = step(num_tokens, num_tokens, num_kv_heads, group, head_dim, dtype, cache_dtype)
    scales = dict(k_scale=scale, v_scale=scale / 2)
    want = fused.rope_kv_write_reference(*args, **scales)
    got = fused.rope_kv_write(*args, interpret=True, **scales)
    assert_same(got, want)


def test_bad_shapes_are_refused():
    qkv, cos, sin, k_cache, v_cache, slots = step(1, 4, 2, 2, 64)
    with pytest.raises(ValueError, match="G \\+ 2"):
        fused.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots[:3], interpret=True)


def test_lowers_for_cuda():
    sds = jax.ShapeDtypeStruct
    text = lower_for_h200(fused.rope_kv_write, sds((1, 8, 6, 128), jnp.bfloat16),
                          sds((1, 1, 64), jnp.float32), sds((1, 1, 64), jnp.float32),
                          sds((64, 16, 8, 128), jnp.bfloat16), sds((64, 16, 8, 128), jnp.bfloat16),
                          sds((1,), jnp.int32))
    assert "rope_kv_write" in text and "triton" in text


def test_gpu_script_checks_and_times_both_paths(tmp_path):
    """benchmarks/experiments/rope_kv_write_gpu.py --cpu (interpreted, wall time): both paths
    agree and get a time at each token count."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "experiments",
                                                       "rope_kv_write_gpu.py"), "--cpu",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "rope_kv_write.json").read_text())["rows"]
    assert {(r["kernel"], r["tokens"]) for r in rows} == {(k, t) for k in ("xla", "fused")
                                                          for t in (1, 5)}
    assert all(r["err"] < 1e-2 and r["us_per_step"] > 0 for r in rows)
