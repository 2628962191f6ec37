"""Batched multi-LoRA kernels (pallas_kernels/lora.py) in interpret mode against their pure-jnp
references and a float64 numpy product: ragged slot assignments (slot 0 mixed in, one slot's
tokens scattered, all slot 0, all one slot), shapes off the tiles, NaN-poisoned weights that must
never reach another slot's tokens; one compilation whatever the slot ids; the CUDA lowering at
an 8B-like shape; and the GPU benchmark's --cpu run."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CompileCounter, lower_for_h200

from pallas_kernels.lora import (_expand, _shrink, lora_expand, lora_expand_reference, lora_shrink,
                                 lora_shrink_reference)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assign(kind: str, num_tokens: int, num_slots: int, rng) -> np.ndarray:
    if kind == "ragged":  # every slot, 0 included, in random order
        return rng.integers(0, num_slots, num_tokens)
    if kind == "scattered":  # the last slot's tokens every third one, slot 0 between
        return np.where(np.arange(num_tokens) % 3 == 1, num_slots - 1, 0)
    if kind == "all_zero":
        return np.zeros(num_tokens, np.int64)
    return np.full(num_tokens, 1)  # "one_slot"


def random_lora(seed, num_tokens, hidden, rank, n_dim, num_slots, kind, dtype):
    """x, a, b (slot 0 zero, as the engine keeps it), base, slot_ids; weights scaled so that
    every product is about unit size."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((num_slots, hidden, rank)) / np.sqrt(hidden)
    b = rng.standard_normal((num_slots, rank, n_dim)) / np.sqrt(rank)
    a[0], b[0] = 0, 0
    x, base = rng.standard_normal((num_tokens, hidden)), rng.standard_normal((num_tokens, n_dim))
    cast = lambda v: jnp.asarray(v, dtype)
    slots = jnp.asarray(assign(kind, num_tokens, num_slots, rng), jnp.int32)
    return cast(x), cast(a), cast(b), cast(base), slots


def exact_shrink(x, a, slots):
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    return np.einsum("th,thr->tr", x, a[np.asarray(slots)])


def exact_expand(base, y, b, slots):
    y, b = np.asarray(y, np.float64), np.asarray(b, np.float64)
    return np.asarray(base, np.float64) + np.einsum("tr,trn->tn", y, b[np.asarray(slots)])


def close(got, want, dtype):
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=tol, atol=tol)


F32, BF16 = jnp.float32, jnp.bfloat16
CASES = [  # T, H, R, N, S, assignment, dtype
    (1, 128, 16, 128, 3, "one_slot", F32),  # decode, one token
    (1, 96, 8, 72, 2, "all_zero", BF16),
    (37, 200, 8, 72, 5, "ragged", F32),  # H, N, T off the tiles
    (37, 200, 8, 72, 5, "ragged", BF16),
    (70, 160, 32, 200, 17, "ragged", F32),  # more slots than tokens per tile
    (45, 96, 16, 64, 4, "scattered", BF16),
]


@pytest.mark.parametrize("case", CASES)
def test_kernels_match_references(case):
    *shape, kind, dtype = case
    x, a, b, base, slots = random_lora(sum(shape), *shape, kind, dtype)
    y = lora_shrink(x, a, slots, interpret=True)
    y_ref = lora_shrink_reference(x, a, slots)
    assert y.shape == (x.shape[0], a.shape[2]) and y.dtype == dtype
    close(y, y_ref, dtype)
    close(y_ref, exact_shrink(x, a, slots), dtype)
    out = lora_expand(base, y_ref, b, slots, interpret=True)
    out_ref = lora_expand_reference(base, y_ref, b, slots)
    assert out.shape == base.shape and out.dtype == dtype
    close(out, out_ref, dtype)
    close(out_ref, exact_expand(base, y_ref, b, slots), dtype)
    zero = np.asarray(slots) == 0  # no adapter: y exactly zero, base exactly kept
    np.testing.assert_array_equal(np.asarray(y, np.float32)[zero], 0)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[zero],
                                  np.asarray(base, np.float32)[zero])


def test_explicit_tiles_split_h_and_share_row_tiles():
    """H split three ways (the last split short), row tiles holding several slots' tokens."""
    x, a, b, base, slots = random_lora(5, 90, 200, 16, 144, 6, "ragged", jnp.float32)
    y = _shrink(x, a, slots, block_m=16, block_k=32, num_splits=3, interpret=True)
    close(y, exact_shrink(x, a, slots), jnp.float32)
    out = _expand(base, y, b, slots, block_m=16, block_n=64, interpret=True)
    close(out, exact_expand(base, y, b, slots), jnp.float32)


def test_no_slot_leaks_into_another_slots_tokens():
    """Slot 2's weights NaN: every other token is exact. Slot 0's weights and the slot-0 rows of
    y NaN too: the kernels never read them (zeros out of shrink, base out of expand)."""
    x, a, b, base, slots = random_lora(9, 50, 96, 16, 80, 4, "ragged", jnp.float32)
    slots = slots.at[:4].set(jnp.asarray([2, 0, 2, 3]))
    clean_a, clean_b = a.at[2].set(0), b.at[2].set(0)
    poisoned_a, poisoned_b = a.at[2].set(jnp.nan).at[0].set(jnp.nan), b.at[2].set(jnp.nan)
    poisoned_b = poisoned_b.at[0].set(jnp.nan)
    other = np.asarray(slots) != 2
    zero = np.asarray(slots) == 0
    y = np.asarray(lora_shrink(x, poisoned_a, slots, interpret=True))
    assert np.isnan(y[~other]).all()  # the poison reached slot 2's own tokens
    close(y[other], exact_shrink(x, clean_a, slots)[other], jnp.float32)
    np.testing.assert_array_equal(y[zero], 0)
    y_in = jnp.where(jnp.asarray(zero)[:, None], jnp.nan, jnp.asarray(np.nan_to_num(y)))
    out = np.asarray(lora_expand(base, y_in, poisoned_b, slots, interpret=True))
    assert np.isnan(out[~other]).all()
    close(out[other], exact_expand(base, np.nan_to_num(y), clean_b, slots)[other], jnp.float32)
    np.testing.assert_array_equal(out[zero], np.asarray(base)[zero])


def test_new_slot_ids_do_not_recompile():
    x, a, b, base, slots = random_lora(3, 20, 64, 16, 32, 5, "ragged", jnp.float32)
    run = jax.jit(lambda x, base, s: lora_expand(base, lora_shrink(x, a, s, interpret=True), b,
                                                 s, interpret=True))
    jax.block_until_ready(run(x, base, slots))
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        for seed in range(3):
            new = jnp.asarray(np.random.default_rng(seed).integers(0, 5, 20), jnp.int32)
            close(run(x, base, new), exact_expand(base, exact_shrink(x, a, new), b, new),
                  jnp.float32)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0


def test_bad_shapes_are_refused():
    x, a, b, base, slots = random_lora(1, 8, 64, 16, 32, 3, "ragged", jnp.float32)
    with pytest.raises(ValueError, match=r"a \[S, H, R\]"):
        lora_shrink(x, a[:, :32], slots, interpret=True)
    with pytest.raises(ValueError, match=r"b \[S, R, N\]"):
        lora_expand(base, jnp.zeros((8, 8)), b, slots, interpret=True)
    with pytest.raises(ValueError, match=r"slot_ids \[T\]"):
        lora_shrink(x, a, slots[:4], interpret=True)


@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_kernels_lower_for_cuda(num_tokens):
    """An 8B-like shape: H 4096, R 16, N 6144, 16 adapters + slot 0, bf16."""
    sds = jax.ShapeDtypeStruct
    x, y = sds((num_tokens, 4096), jnp.bfloat16), sds((num_tokens, 16), jnp.bfloat16)
    slots = sds((num_tokens,), jnp.int32)
    text = lower_for_h200(lora_shrink, x, sds((17, 4096, 16), jnp.bfloat16), slots)
    assert "lora_shrink" in text
    text = lower_for_h200(lora_expand, sds((num_tokens, 6144), jnp.bfloat16), y,
                          sds((17, 16, 6144), jnp.bfloat16), slots)
    assert "lora_expand" in text


def test_gpu_benchmark_runs_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "lora_kernels_gpu.py"),
                          "--cpu", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "lora_kernels.json") as f:
        result = json.load(f)
    rows = result["rows"]
    assert result["odd_shape_rel_err"] < 2e-2
    assert rows and all(row["max_rel_err"] < 2e-2 for row in rows)
    assert all(row["lora_us"] > 0 or np.isnan(row["lora_us"]) for row in rows)
    assert "| T |" in out.stdout
