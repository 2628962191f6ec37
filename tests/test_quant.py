"""Quantisation: FP8 round trips against numpy, GPTQ/AWQ unpacking against numpy references
written from the formats' definitions, tiny models' logits in fp8 and int4 against fp32, and the
start-up refusals."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from conftest import write_fp8_checkpoint, write_fp8_kv_scaled
from jaxllm.config import ModelConfig
from jaxllm.engine.args import EngineArgs
from jaxllm.loader import load_model
from jaxllm.loader.fp8_writer import calibrated_input_scales
from jaxllm.loader.gptq_writer import write_rtn_gptq
from jaxllm.loader.quant_checkpoint import build_weight
from jaxllm.models import forward, fuse_params
from jaxllm.models.quant import (GEMV_MAX_TOKENS, Fp8Weight, Int4Weight, dequantize, linear,
                                 quantize_fp8, quantize_params_fp8)
from jaxllm.worker.batch import SeqChunk, build_step_batch
from jaxllm.worker.kv_cache import cache_shape


def test_fp8_quantize_matches_numpy():
    w = np.random.default_rng(0).standard_normal((96, 40)).astype(np.float32) * 3
    q = quantize_fp8(jnp.asarray(w))
    scale = np.abs(w).max(axis=0) / 448.0  # per output channel
    want = (w / scale).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(q.values, np.float32), want.T.astype(np.float32))
    back = np.asarray(dequantize(q))
    assert np.all(np.abs(back - w) <= 2 ** -4 * np.abs(w) + 2 ** -9 * scale)  # e4m3 rounding
    assert np.asarray(q.values).max() == 448  # each channel's max hits the top of the range


def test_fp8_linear_with_per_token_activations():
    """W8A8 (more tokens than the GEMV takes)."""
    num_tokens = GEMV_MAX_TOKENS + 7
    rng = np.random.default_rng(1)
    x = rng.standard_normal((num_tokens, 96)).astype(np.float32)
    x[3] *= 100  # one loud token does not cost the others precision (per-token scales)
    w = rng.standard_normal((96, 2, 24)).astype(np.float32)
    got = np.asarray(linear(jnp.asarray(x), quantize_fp8(jnp.asarray(w))))
    want = np.einsum("tk,kgo->tgo", x, w)
    for t in range(num_tokens):  # e4m3 on both operands (one scale for all tokens: ~100%)
        assert np.linalg.norm(got[t] - want[t]) / np.linalg.norm(want[t]) < 0.07


@pytest.mark.parametrize("num_tokens", [4, GEMV_MAX_TOKENS + 4])  # the GEMV, W8A8
def test_fp8_linear_in_float16_stays_finite(num_tokens):
    """A float16 model's FP8 product is not written in float16: unscaled products of float8
    values (up to 448 each) over K = 4096 overflow it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((num_tokens, 4096)).astype(np.float32)
    w = (rng.standard_normal((4096, 256)) * 0.02).astype(np.float32)
    got = np.asarray(linear(jnp.asarray(x, jnp.float16), quantize_fp8(jnp.asarray(w, jnp.float16))),
                     np.float32)
    want = x @ w
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


# -- GPTQ and AWQ: packing written here from the formats' definitions -------------------------
def gptq_pack(q, zeros, v1=True):
    """qweight[r, n] nibble i = q[8r + i, n]; qzeros[g, c] nibble i = zeros[g, 8c + i] (- 1)."""
    k, n = q.shape
    qweight = np.zeros((k // 8, n), np.uint32)
    for r in range(k // 8):
        for i in range(8):
            qweight[r] |= q[8 * r + i].astype(np.uint32) << (4 * i)
    z = (zeros.astype(np.int64) - (1 if v1 else 0)) & 0xF
    qzeros = np.zeros((zeros.shape[0], n // 8), np.uint32)
    for c in range(n // 8):
        for i in range(8):
            qzeros[:, c] |= z[:, 8 * c + i].astype(np.uint32) << (4 * i)
    return qweight.view(np.int32), qzeros.view(np.int32)


AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i holds column 8c + order[i]


def awq_pack(a):
    rows, n = a.shape
    out = np.zeros((rows, n // 8), np.uint32)
    for c in range(n // 8):
        for i, col in enumerate(AWQ_PACK_ORDER):
            out[:, c] |= a[:, 8 * c + col].astype(np.uint32) << (4 * i)
    return out.view(np.int32)


def random_quantized(seed, k, n, group, sym, act_order):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (k, n)).astype(np.uint8)
    zeros = np.full((k // group, n), 8, np.uint8) if sym else rng.integers(
        0, 16, (k // group, n)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.1, (k // group, n)).astype(np.float16)
    g_idx = np.arange(k) // group
    if act_order:
        g_idx = g_idx[rng.permutation(k)]  # each group keeps `group` rows, scattered over K
    dense = (q.astype(np.float32) - zeros[g_idx]) * scales[g_idx].astype(np.float32)
    return q, zeros, scales, g_idx.astype(np.int32), dense


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym,act_order", [(True, False), (False, True), (True, True)])
def test_gptq_unpacking_matches_numpy(group, sym, act_order):
    k, n = 384, 48  # K a multiple of every group; not of 128 x 8 words (padding)
    q, zeros, scales, g_idx, dense = random_quantized(group, k, n, group, sym, act_order)
    qweight, qzeros = gptq_pack(q, zeros)
    w = build_weight("gptq", dict(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx),
                     {"checkpoint_format": "gptq"}, jnp.float32)
    assert isinstance(w, Int4Weight) and w.shape == (k, n)
    assert (w.perm is not None) == act_order
    np.testing.assert_allclose(np.asarray(dequantize(w)), dense, rtol=1e-6, atol=1e-6)
    x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), w)), x @ dense, rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("group", [32, 128])
def test_awq_unpacking_matches_numpy(group):
    k, n = 256, 64
    q, zeros, scales, _, dense = random_quantized(7, k, n, group, False, False)
    w = build_weight("awq", dict(qweight=awq_pack(q), qzeros=awq_pack(zeros), scales=scales),
                     {}, jnp.float32)
    np.testing.assert_allclose(np.asarray(dequantize(w)), dense, rtol=1e-6, atol=1e-6)


def test_fp8_checkpoint_tensors_per_tensor_and_per_channel():
    rng = np.random.default_rng(4)
    values = rng.standard_normal((24, 32)).astype(ml_dtypes.float8_e4m3fn)  # [N, K]
    for scale in (np.float32(0.5), rng.uniform(0.1, 1, (24, 1)).astype(np.float32)):
        w = build_weight("fp8", {"weight": values, "weight_scale": scale}, {}, jnp.bfloat16)
        assert isinstance(w, Fp8Weight) and w.shape == (32, 24)
        want = values.astype(np.float32).T * np.reshape(scale, -1)
        np.testing.assert_allclose(np.asarray(dequantize(w)), want, rtol=1e-6)


def block_dequantized(values, scale, block):
    """The block-wise format's definition: w[n, k] = values[n, k] * scale[n // bn, k // bk]."""
    n, k = values.shape
    rows, cols = np.arange(n)[:, None] // block[0], np.arange(k)[None, :] // block[1]
    return values.astype(np.float32) * scale[rows, cols]


def per_channel_fp8(w):
    """--quantization fp8's rounding of w [N, K] per output channel, in numpy."""
    scale = np.maximum(np.abs(w).max(axis=1), 1e-12) / 448.0
    return (w / scale[:, None]).astype(ml_dtypes.float8_e4m3fn), scale


def assert_same_fp8(got, want):
    """Equal float8 values, but for the rare value that lies within an fp32 rounding of a
    float8 tie (XLA's division and numpy's may round it apart): those one float8 step away."""
    got, want = np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)
    apart = got != want
    assert apart.mean() < 1e-3, apart.mean()
    assert np.all(np.abs(got[apart].astype(int) - want[apart].astype(int)) == 1)


@pytest.mark.parametrize("method,qconfig,scale_name", [
    ("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_scale_inv"),
    ("compressed-tensors", {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "block",
                    "block_structure": [64, 32]}}}}, "weight_scale"),
])
def test_fp8_block_scales_kept_or_requantised_per_channel(method, qconfig, scale_name):
    """Block-wise scales (partial last blocks: N, K not multiples of the block) are read from
    their definition. On one device they are kept (a block's scale on each of its rows of
    output channels): the weight dequantises to the stored one exactly. For a mesh or experts
    they are requantised per output channel, as --quantization fp8 would round the
    block-dequantised weight; rows whose blocks share a scale and reach 448 keep their stored
    values exactly."""
    from jaxllm.loader.quant_checkpoint import fp8_block_size, requantize_blocks
    from jaxllm.models.quant import Fp8BlockWeight
    block = fp8_block_size(qconfig)
    rng = np.random.default_rng(7)
    n, k = 200, 300
    values = (rng.standard_normal((n, k)) * 100).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(1e-3, 1e-2, (-(-n // block[0]), -(-k // block[1]))).astype(np.float32)
    scale[0] = scale[0, 0]  # the first block row: one scale along K
    values[:block[0], 5] = 448
    exact = block_dequantized(values, scale, block)
    kept = build_weight(method, {"weight": values, scale_name: scale}, qconfig, jnp.bfloat16)
    assert isinstance(kept, Fp8BlockWeight) and kept.shape == (k, n) and kept.group == block[1]
    np.testing.assert_array_equal(np.asarray(dequantize(kept)).T, exact)
    w = requantize_blocks(values, scale, block)
    assert isinstance(w, Fp8Weight) and w.shape == (k, n)
    want_values, want_scale = per_channel_fp8(exact)
    assert_same_fp8(w.values, want_values)
    np.testing.assert_allclose(np.asarray(w.scale), want_scale, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(w.values)[:block[0]].view(np.uint8),
                                  values[:block[0]].view(np.uint8))
    back = np.asarray(dequantize(w)).T
    assert np.all(np.abs(back - exact) <= 2 ** -4 * np.abs(exact) + 2 ** -9 * want_scale[:, None])


# -- tiny models ----------------------------------------------------------------------------
def logits_of(loaded, params, prompt):
    args = loaded.args
    batch = build_step_batch([SeqChunk(prompt, 0, [1, 2, 3, 4])], 32, 2, 4, 8)
    batch = jax.tree.map(jnp.asarray, batch)
    batch.logits_indices = jnp.arange(len(prompt), dtype=jnp.int32)
    shape = cache_shape(8, 8, args.num_kv_heads, args.head_dim)
    caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(args.num_layers)]
    logits, _ = jax.jit(forward, static_argnames="args")(params, caches, batch, args=args)
    return np.asarray(logits)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


PROMPT = [5, 17, 99, 3, 250, 31, 8, 77, 120, 64, 11]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_tiny_llama_logits_fp8_within_tolerance(tiny_llama_dir, dtype):
    """Against the fp32 model's logits, whatever the model's dtype (a float16 model once got
    inf: its FP8 products were written in float16)."""
    want = logits_of(*_fused(tiny_llama_dir, "float32"), PROMPT)
    loaded, params = _fused(tiny_llama_dir, dtype)
    got = logits_of(loaded, quantize_params_fp8(params), PROMPT).astype(np.float32)
    # stated tolerance: 15% of the logits' norm (W8A8 of random weights, two layers: ~10%)
    assert np.isfinite(got).all() and rel(got, want) < 0.15


def _fused(model_dir, dtype):
    loaded = load_model(model_dir, dtype)
    return loaded, fuse_params(loaded.params, loaded.args.num_kv_heads)


def test_tiny_moe_logits_fp8_experts_within_tolerance(tmp_path):
    """--quantization fp8 on an MoE: the experts too (Fp8Experts, W8A16 in the grouped matmul),
    logits within the dense model's stated tolerance; quantising the experts changes them."""
    from test_moe import save_tiny_moe

    from jaxllm.models.quant import EXPERT_NAMES, Fp8Experts
    loaded = load_model(save_tiny_moe("qwen3_moe", str(tmp_path / "moe"), seed=3), "float32")
    params = fuse_params(loaded.params, loaded.args.num_kv_heads)
    want = logits_of(loaded, params, PROMPT)
    quantized = quantize_params_fp8(fuse_params(
        load_model(str(tmp_path / "moe"), "float32").params, loaded.args.num_kv_heads))
    experts = [layer[name] for layer in quantized["layers"] for name in EXPERT_NAMES
               if name in layer]
    assert experts and all(isinstance(w, Fp8Experts) for w in experts)
    got = logits_of(loaded, quantized, PROMPT)
    assert rel(got, want) < 0.15
    plain_experts = [{**layer, **{n: params["layers"][i][n] for n in EXPERT_NAMES if n in layer}}
                     for i, layer in enumerate(quantized["layers"])]
    assert rel(logits_of(loaded, {**quantized, "layers": plain_experts}, PROMPT), got) > 1e-4


@pytest.mark.parametrize("kind,quant_method", [("qwen3_moe", "fp8"),
                                               ("qwen2_moe", "compressed-tensors")])
def test_fp8_moe_checkpoint_loads_its_experts_as_stored(kind, quant_method, tmp_path):
    """A pre-quantised FP8 MoE checkpoint (each expert's linears float8 with per-channel
    scales, the router 16-bit): the experts load as Fp8Experts holding the stored values and
    scales, the dense and shared-expert linears as Fp8Weight, and the logits are those of the
    dequantised weights (to fp32 rounding) and near the 16-bit model's."""
    from test_moe import save_tiny_moe

    from jaxllm.models.quant import EXPERT_NAMES, Fp8Experts, Fp8Weight
    base_dir = save_tiny_moe(kind, str(tmp_path / "base"), seed=5)
    qconfig = ({"quant_method": "fp8", "activation_scheme": "dynamic"} if quant_method == "fp8"
               else {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
                   "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8,
                                                      "strategy": "channel"}}}})
    out = write_fp8_checkpoint(base_dir, str(tmp_path / "fp8"), qconfig)
    quant = load_model(out, "float32", quantization=quant_method)
    layer = next(l for l in quant.params["layers"] if "experts_gate" in l)
    assert all(isinstance(layer[n], Fp8Experts) for n in EXPERT_NAMES)
    assert isinstance(layer["wq"], Fp8Weight) and not isinstance(layer["router"], Fp8Weight)
    if kind == "qwen2_moe":
        assert isinstance(layer["shared_gate"], Fp8Weight)
    import torch
    from safetensors.torch import load_file
    stored = load_file(os.path.join(out, "model.safetensors"))
    index = next(i for i, l in enumerate(quant.params["layers"]) if l is layer)
    prefix = f"model.layers.{index}.mlp.experts.2.up_proj"
    np.testing.assert_array_equal(np.asarray(layer["experts_up"].values[2]).T.view(np.uint8),
                                  stored[f"{prefix}.weight"].view(torch.uint8).numpy())
    np.testing.assert_array_equal(np.asarray(layer["experts_up"].scale[2]),
                                  stored[f"{prefix}.weight_scale"].numpy().reshape(-1))
    got = logits_of(quant, fuse_params(quant.params, quant.args.num_kv_heads), PROMPT)
    base = load_model(base_dir, "float32")
    want = logits_of(base, fuse_params(base.params, base.args.num_kv_heads), PROMPT)
    assert rel(got, want) < 0.15  # the dense model's stated FP8 tolerance
    # the writer's per-channel rounding is --quantization fp8's: the same weights, so the same
    # logits as the 16-bit checkpoint quantised at load
    at_load = quantize_params_fp8(fuse_params(load_model(base_dir, "float32").params,
                                              base.args.num_kv_heads))
    np.testing.assert_allclose(got, logits_of(base, at_load, PROMPT), rtol=1e-5, atol=1e-5)


def test_block_fp8_checkpoint_runs_block_scaled(tiny_llama_dir, tmp_path):
    """A block-wise FP8 checkpoint (DeepSeek's / Qwen3's FP8 layout) on one device keeps its
    blocks: each linear dequantises to the stored weight exactly, and the logits are those of
    the stored weights with the activations quantised per token and group of 32 (closer than
    per-channel requantisation gets, and within FP8's tolerance of the 16-bit model)."""
    from jaxllm.loader.quant_checkpoint import requantize_blocks
    from jaxllm.loader.safetensors_io import iter_tensors
    from jaxllm.models.quant import Fp8BlockWeight
    block = (16, 32)
    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic",
               "weight_block_size": list(block)}
    out = write_fp8_checkpoint(tiny_llama_dir, str(tmp_path / "fp8"), qconfig)
    quant = load_model(out, "float32", quantization="fp8")
    stored = dict(iter_tensors(os.path.join(out, "model.safetensors")))
    prefix = "model.layers.1.mlp.down_proj"
    down = quant.params["layers"][1]["w_down"]
    assert isinstance(down, Fp8BlockWeight) and down.group == block[1]
    exact = block_dequantized(stored[f"{prefix}.weight"], stored[f"{prefix}.weight_scale_inv"],
                              block)
    np.testing.assert_array_equal(np.asarray(dequantize(down)).T, exact)

    got = logits_of(quant, fuse_params(quant.params, quant.args.num_kv_heads), PROMPT)
    plain = jax.tree.map(lambda w: dequantize(w) if isinstance(w, Fp8BlockWeight) else w,
                         quant.params, is_leaf=lambda w: isinstance(w, Fp8BlockWeight))
    stored_weights = logits_of(quant, fuse_params(plain, quant.args.num_kv_heads), PROMPT)
    requantised = jax.tree.map(
        lambda w: requantize_blocks(np.asarray(w.values), np.asarray(w.scale)[::block[0]],
                                    block) if isinstance(w, Fp8BlockWeight) else w,
        quant.params, is_leaf=lambda w: isinstance(w, Fp8BlockWeight))
    per_channel = logits_of(quant, fuse_params(requantised, quant.args.num_kv_heads), PROMPT)
    assert 0 < rel(got, stored_weights) < 0.5 * rel(per_channel, stored_weights)
    base = load_model(tiny_llama_dir, "float32")
    want = logits_of(base, fuse_params(base.params, base.args.num_kv_heads), PROMPT)
    assert rel(got, want) < 0.15  # the dense model's FP8 tolerance


def test_block_fp8_kept_only_where_each_device_holds_whole_groups():
    """A block-wise linear keeps its blocks where the kernel takes its groups (32 rows of K or
    more) and a K split leaves whole groups on each device; else it is requantised (the TP runs
    of block-scaled weights: tests/test_quant_tp.py)."""
    from types import SimpleNamespace

    from jaxllm.loader.quant_checkpoint import keeps_blocks
    split = lambda ways: SimpleNamespace(spec=("tensor", None),  # noqa: E731
                                         mesh=SimpleNamespace(shape={"tensor": ways}))
    assert keeps_blocks((128, 128), 4096, None) and keeps_blocks((16, 32), 40, None)
    assert keeps_blocks((128, 128), 14336, split(8))  # 1,792 rows a device: 14 groups
    assert not keeps_blocks((16, 32), 40, split(2))  # 20 rows a device
    assert not keeps_blocks((16, 16), 64, None)  # groups under the FP8 dot's K
    assert not keeps_blocks(None, 64, None)


def test_block_fp8_checkpoint_requantised_where_blocks_cannot_run(tmp_path):
    """Blocks of fewer than 32 rows of K (and MoE experts) are requantised per output channel
    (experts as Fp8Experts): each linear the numpy requantisation of its block-dequantised
    stored weight, and the logits within FP8's stated tolerance of the 16-bit model's."""
    from test_moe import save_tiny_moe

    from jaxllm.loader.quant_checkpoint import fp8_block_size
    from jaxllm.loader.safetensors_io import iter_tensors
    from jaxllm.models.quant import Fp8Experts
    qconfig = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "block",
                                           "block_structure": [32, 16]}}}}
    base_dir = save_tiny_moe("qwen3_moe", str(tmp_path / "base"), seed=5)
    out = write_fp8_checkpoint(base_dir, str(tmp_path / "fp8"), qconfig)
    quant = load_model(out, "float32", quantization=qconfig["quant_method"])
    stored = dict(iter_tensors(os.path.join(out, "model.safetensors")))
    prefix = "model.layers.1.mlp.experts.3.down_proj"
    assert stored[f"{prefix}.weight_scale"].ndim == 2
    want_values, want_scale = per_channel_fp8(block_dequantized(
        stored[f"{prefix}.weight"], stored[f"{prefix}.weight_scale"], fp8_block_size(qconfig)))
    down = quant.params["layers"][1]["experts_down"]
    assert isinstance(down, Fp8Experts) and isinstance(quant.params["layers"][1]["wo"], Fp8Weight)
    assert_same_fp8(np.asarray(down.values[3]).T, want_values)
    np.testing.assert_allclose(np.asarray(down.scale[3]), want_scale, rtol=1e-6)
    got = logits_of(quant, fuse_params(quant.params, quant.args.num_kv_heads), PROMPT)
    base = load_model(base_dir, "float32")
    want = logits_of(base, fuse_params(base.params, base.args.num_kv_heads), PROMPT)
    assert np.isfinite(got).all() and rel(got, want) < 0.15  # the dense model's FP8 tolerance


@pytest.mark.parametrize("sym,desc_act", [(True, False), (False, True)])
def test_tiny_model_logits_int4_rtn_gptq(sym, desc_act, tiny_qwen3_dir, tmp_path):
    """The GPTQ checkpoint written by RTN loads packed and gives the logits of its dequantised
    weights (to fp32 rounding), and stays near the fp32 model."""
    out = write_rtn_gptq(tiny_qwen3_dir, str(tmp_path / "gptq"), group_size=32, sym=sym,
                         desc_act=desc_act)
    quant = load_model(out, "float32", quantization="gptq")
    layer = quant.params["layers"][0]
    assert isinstance(layer["wq"], Int4Weight) and (layer["wq"].perm is not None) == desc_act
    params = fuse_params(quant.params, quant.args.num_kv_heads)
    got = logits_of(quant, params, PROMPT)
    dense = jax.tree.map(dequantize, params, is_leaf=lambda x: isinstance(x, Int4Weight))
    np.testing.assert_allclose(got, logits_of(quant, dense, PROMPT), rtol=1e-4, atol=1e-4)
    base = load_model(tiny_qwen3_dir, "float32")
    want = logits_of(base, fuse_params(base.params, base.args.num_kv_heads), PROMPT)
    assert rel(got, want) < 0.4  # stated tolerance: 4-bit RTN of random weights (~30%)


# -- an FP8 KV cache's static scales from the checkpoint -----------------------------------
KV_SCALES = {0: (3.0, 0.75), 1: (0.4, 5.0)}  # layer -> (k_scale, v_scale)


def write_kv_scaled(model_dir: str, out_dir: str) -> str:
    return write_fp8_kv_scaled(model_dir, out_dir, KV_SCALES)


def fp8_cache_logits(args, params, prompt, attn=None, write_kv=None):
    from pallas_kernels.kv_write import write_kv_reference
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    batch = build_step_batch([SeqChunk(prompt, 0, [1, 2, 3, 4])], 32, 2, 4, 8)
    batch = jax.tree.map(jnp.asarray, batch)
    batch.logits_indices = jnp.arange(len(prompt), dtype=jnp.int32)
    shape = cache_shape(8, 8, args.num_kv_heads, args.head_dim)
    caches = [(jnp.zeros(shape, jnp.float8_e4m3fn),) * 2 for _ in range(args.num_layers)]
    logits, _ = forward(params, caches, batch, args=args,
                        attn=attn or ragged_paged_attention_reference,
                        write_kv=write_kv or write_kv_reference)
    return np.asarray(logits)


def test_checkpoint_kv_scales_load_per_layer(tiny_llama_dir, tmp_path):
    loaded = load_model(write_kv_scaled(tiny_llama_dir, str(tmp_path)), "float32",
                        quantization="compressed-tensors")
    assert loaded.args.kv_cache_scales
    for layer, (k, v) in KV_SCALES.items():
        got = loaded.params["layers"][layer]
        assert got["k_scale"].shape == () and float(got["k_scale"]) == pytest.approx(k)
        assert float(got["v_scale"]) == pytest.approx(v)


def test_checkpoint_kv_scales_equal_the_kernels_own_scales(tiny_llama_dir, tmp_path):
    """The scales applied around the kernels give what the kernels' static k_scale / v_scale
    give (the pages hold k / k_scale), and differ from ignoring them."""
    from pallas_kernels.kv_write import write_kv_reference
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
    loaded = load_model(write_kv_scaled(tiny_llama_dir, str(tmp_path)), "float32",
                        quantization="compressed-tensors")
    params = fuse_params(loaded.params, loaded.args.num_kv_heads)
    got = fp8_cache_logits(loaded.args, params, PROMPT)
    unscaled = dict(params, layers=[{n: w for n, w in layer.items()
                                     if n not in ("k_scale", "v_scale")}
                                    for layer in params["layers"]])
    want = fp8_cache_logits(loaded.args, unscaled, PROMPT,
                            attn=_with_layer_scales(ragged_paged_attention_reference),
                            write_kv=_with_layer_scales(write_kv_reference))
    assert np.isfinite(got).all() and rel(got, want) < 1e-5
    assert rel(got, fp8_cache_logits(loaded.args, unscaled, PROMPT)) > 1e-3


def test_engine_reads_kv_scales_with_an_fp8_cache_only(tiny_llama_dir, tmp_path, caplog):
    from jaxllm import LLM, SamplingParams
    model = write_kv_scaled(tiny_llama_dir, str(tmp_path))
    engine = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                  num_gpu_blocks_override=24, block_size=8, enforce_eager=True,
                  compilation_cache_dir=None)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for kv_cache_dtype, note in (("fp8", "KV cache scales per layer from the checkpoint"),
                                 ("auto", "the checkpoint's KV cache scales are unused")):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            llm = LLM(model, kv_cache_dtype=kv_cache_dtype, **engine)
        assert note in caplog.text
        [out] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
        outputs[kv_cache_dtype] = out.outputs[0].token_ids
    assert outputs["fp8"][0] == outputs["auto"][0]  # the prompt's next token survives FP8 pages


def test_cpu_step_keeps_a_float8_cache_as_bits_and_never_copies_it(tiny_llama_dir):
    """On a CPU the runner keeps a float8 cache as its uint8 bits, and the compiled step holds no
    float8 array of the cache's shape: no whole-cache bitcast copy in or out (those made a
    tiny model's step scale with the cache's size)."""
    from jaxllm import LLM, SamplingParams
    from jaxllm.worker import model_runner
    from jaxllm.worker.kv_cache import Float8Bits
    llm = LLM(tiny_llama_dir, kv_cache_dtype="fp8", dtype="float32", max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks_override=24, block_size=8,
              enforce_eager=True, compilation_cache_dir=None)
    runner = llm.llm_engine.runner
    k_cache = runner.kv_caches[0][0]
    assert isinstance(k_cache, Float8Bits) and k_cache.dtype == jnp.float8_e4m3fn
    assert k_cache.bits.dtype == jnp.uint8
    steps, run_step = [], runner._run_step

    def recording(inputs, stages):
        steps.append(model_runner.pack(inputs) + (stages,))
        return run_step(inputs, stages)
    runner._run_step = recording
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    written = np.asarray(runner.kv_caches[0][0].bits)
    assert np.count_nonzero(written) > 0  # the prompt's K went in as bits
    hlo = runner._lower(*steps[0]).compile().as_text()
    assert "u8[" + ",".join(map(str, k_cache.bits.shape)) + "]" in hlo
    assert "f8e4m3fn[" + ",".join(map(str, k_cache.bits.shape)) + "]" not in hlo


def _with_layer_scales(kernel):
    """kernel, given on its i-th call (layer i of a forward) that layer's static scales."""
    calls = []

    def run(*args, **kwargs):
        k_scale, v_scale = KV_SCALES[len(calls) % len(KV_SCALES)]
        calls.append(None)
        return kernel(*args, k_scale=k_scale, v_scale=v_scale, **kwargs)
    return run


# -- start-up refusals ----------------------------------------------------------------------
def config_with(tmp_path, quantization_config=None, **extra):
    from conftest import TINY_CONFIGS
    cfg = dict(TINY_CONFIGS["llama"], **extra)
    if quantization_config:
        cfg["quantization_config"] = quantization_config
    os.makedirs(tmp_path, exist_ok=True)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    return str(tmp_path)


@pytest.mark.parametrize("requested,qconfig,match", [
    ("bitsandbytes", None, "Unknown quantization method: bitsandbytes"),
    ("gptq", None, "needs a checkpoint quantized with it"),
    ("fp8", {"quant_method": "gptq", "bits": 4, "group_size": 128},
     r"model config \(gptq\) does not match .* `quantization` argument \(fp8\)"),
    (None, {"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit weights"),
    (None, {"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16"),
    (None, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM"),
    (None, {"quant_method": "fp8", "weight_block_size": [128]}, "2-D blocks"),
    (None, {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
     "scale_fmt 'ue8m0'"),
    (None, {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "float", "num_bits": 8, "strategy": "block"}}}}, "block-wise"),
    (None, {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "type": "int", "num_bits": 4, "strategy": "group"}}}}, "float8 weights"),
    (None, {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {
        "type": "float", "num_bits": 8, "strategy": "attn_head"}}, "one per tensor"),
    (None, {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": {
        "type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": True}}, "static"),
])
def test_unsupported_quantization_refused_before_loading(requested, qconfig, match, tmp_path):
    model = config_with(tmp_path, qconfig)  # no weights: refused before any load
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model, quantization=requested).create_engine_config()


def test_quantization_resolution_and_kv_cache_dtype(tmp_path):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert ModelConfig("m", {"quantization_config": gptq}).quantization == "gptq"
    assert ModelConfig("m", {"quantization_config": gptq}, quantization="gptq_marlin"
                       ).quantization == "gptq"
    assert ModelConfig("m", {}, quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(model=config_with(tmp_path), kv_cache_dtype="fp8_e5m2").create_engine_config()


# -- static activation scales (vLLM's activation_scheme static) -----------------------------
def test_fp8_static_checkpoint_tensors():
    """input_scale ([] or [1]) is read with activation_scheme static, ignored with dynamic;
    one missing or not per tensor is refused; fused q/k/v take the largest scale."""
    from jaxllm.models.quant import map_out
    rng = np.random.default_rng(5)
    values = rng.standard_normal((24, 32)).astype(ml_dtypes.float8_e4m3fn)
    tensors = {"weight": values, "weight_scale": np.float32(0.5),
               "input_scale": np.array([0.02], np.float32)}
    static = {"quant_method": "fp8", "activation_scheme": "static"}
    w = build_weight("fp8", tensors, static, jnp.bfloat16)
    assert w.input_scale.shape == () and float(w.input_scale) == np.float32(0.02)
    assert build_weight("fp8", tensors, {"quant_method": "fp8"}, jnp.bfloat16).input_scale is None
    ct = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "tensor",
                              "dynamic": False}}}}
    assert float(build_weight("compressed-tensors", tensors, ct, jnp.bfloat16).input_scale) == \
        np.float32(0.02)
    with pytest.raises(ValueError, match="needs each FP8 linear's input_scale"):
        build_weight("fp8", {k: v for k, v in tensors.items() if k != "input_scale"}, static,
                     jnp.bfloat16)
    with pytest.raises(ValueError, match="one static activation scale per tensor"):
        build_weight("fp8", dict(tensors, input_scale=np.ones(2, np.float32)), static,
                     jnp.bfloat16)
    parts = [build_weight("fp8", dict(tensors, input_scale=np.float32(s)), static, jnp.bfloat16)
             for s in (0.01, 0.03, 0.02)]
    fused = map_out(lambda *a: jnp.concatenate(a, axis=-1), parts)
    assert float(fused.input_scale) == np.float32(0.03)
    with pytest.raises(ValueError, match="mix static and dynamic"):
        map_out(lambda *a: jnp.concatenate(a, axis=-1), [parts[0], Fp8Weight(w.values, w.scale)])


def test_tiny_llama_logits_static_fp8_within_tolerance(tiny_llama_dir, tmp_path):
    """A static FP8 checkpoint, its input scales calibrated on the prompt by HF's model: within
    FP8's tolerance of the fp32 logits (as the dynamic checkpoint), and not the dynamic
    checkpoint's logits; scales 50x too small (most activations saturated) far off: the scales
    are what quantises the activations."""
    static = {"quant_method": "fp8", "activation_scheme": "static"}
    scales = calibrated_input_scales(tiny_llama_dir, [PROMPT])
    assert len(scales) == 2 * 7  # two layers' q, k, v, o, gate, up, down
    # the writer's calibration from its definition: q/k/v share their input, so their scale
    assert len({float(scales[f"model.layers.0.self_attn.{p}_proj.input_scale"])
                for p in "qkv"}) == 1
    base = load_model(tiny_llama_dir, "float32")
    want = logits_of(base, fuse_params(base.params, base.args.num_kv_heads), PROMPT)

    def logits(qconfig, extra, name):
        out = write_fp8_checkpoint(tiny_llama_dir, str(tmp_path / name), qconfig, extra)
        loaded = load_model(out, "float32", quantization="fp8")
        return loaded, logits_of(loaded, fuse_params(loaded.params, loaded.args.num_kv_heads),
                                 PROMPT)

    loaded, got = logits(static, scales, "static")
    assert float(loaded.params["layers"][1]["w_down"].input_scale) == np.float32(
        scales["model.layers.1.mlp.down_proj.input_scale"])
    _, dynamic = logits({"quant_method": "fp8", "activation_scheme": "dynamic"}, scales, "dyn")
    _, saturated = logits(static, {k: np.asarray(v / 50, np.float32) for k, v in
                                   scales.items()}, "saturated")
    assert rel(got, want) < 0.15 and rel(dynamic, want) < 0.15
    assert not np.array_equal(got, dynamic)
    assert rel(saturated, want) > 2 * max(rel(got, want), 0.1)


@pytest.mark.parametrize("qconfig,match", [
    ({"quant_method": "fp8", "activation_scheme": "per_token"},
     "Unsupported activation scheme per_token"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "only supports dynamic activation scheme"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                              "dynamic": False}}}}, "static activation scales one per tensor"),
])
def test_unsupported_static_schemes_refused_before_loading(qconfig, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=config_with(tmp_path, qconfig)).create_engine_config()


def test_dummy_weights_stand_in_for_an_fp8_checkpoint(tmp_path):
    """load_format dummy on a static FP8 checkpoint's config runs FP8 weights with static
    scales (the 8B FP8 preset's route), on a dynamic one FP8 weights without; other methods'
    dummy weights are refused, not run in 16 bits."""
    from jaxllm.engine.model_setup import load_for_engine
    for scheme, want in (("static", 1.0), ("dynamic", None)):
        model = config_with(tmp_path / scheme, {"quant_method": "fp8",
                                                "activation_scheme": scheme})
        config = EngineArgs(model=model, load_format="dummy").create_engine_config()
        params = load_for_engine(config, None).loaded.params
        assert isinstance(params["layers"][0]["w_down"], Fp8Weight)
        stacked = params["layer_stacks"].get("w_down.input_scale")  # one device: [L] stacked
        assert (stacked is None if want is None else np.all(np.asarray(stacked) == want))
    gptq = config_with(tmp_path / "gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match="load_format='dummy' is not supported for gptq"):
        EngineArgs(model=gptq, load_format="dummy").create_engine_config()


def test_fp8_at_load_refused_where_the_16_bit_weights_cannot_fit(monkeypatch):
    """Quantising at load holds the 16-bit weights first: on a device whose pool cannot hold
    them the engine is refused before loading, naming the need and the remedies; a pool that
    holds them passes (a 30B MoE's bf16 weights, ~57 GiB, against 60% and 90% of an 80 GB
    card's pool)."""
    from jax.sharding import AbstractMesh

    from jaxllm.engine import model_setup
    config = EngineArgs(model="qwen3-30b-a3b", load_format="dummy", quantization="fp8",
                        dtype="bfloat16",
                        gpu_memory_utilization=0.6).create_engine_config()
    monkeypatch.setattr(model_setup, "device_memory_limit", lambda: int(0.6 * 79.2 * 2 ** 30))
    with pytest.raises(ValueError, match=r"bfloat16 weights first: about 56\.[0-9] GiB a device, "
                                         r"more than the 47\.5 GiB .*tensor_parallel_size"):
        model_setup.check_fp8_load_fits(config, None)
    # expert parallelism over two devices halves each device's experts: 0.6 then holds its share
    two = AbstractMesh((2, 1, 1), ("data", "tensor", "pipe"))
    with pytest.raises(ValueError, match="more than the 47.5 GiB"):
        model_setup.check_fp8_load_fits(config, two)
    expert_parallel = dataclasses.replace(config.parallel_config, enable_expert_parallel=True)
    model_setup.check_fp8_load_fits(dataclasses.replace(config, parallel_config=expert_parallel),
                                    two)
    monkeypatch.setattr(model_setup, "device_memory_limit", lambda: int(0.9 * 79.2 * 2 ** 30))
    model_setup.check_fp8_load_fits(config, None)
    monkeypatch.setattr(model_setup, "device_memory_limit", lambda: None)  # a CPU
    model_setup.check_fp8_load_fits(config, None)


# -- ModelOpt FP8 checkpoints (NVIDIA's, as TensorRT-LLM's benchmarks use) ------------------
def modelopt_tensors(model_dir: str, scales: dict) -> dict:
    """model_dir's linears as ModelOpt's FP8 export stores them: float8 values with one weight
    scale per tensor ([]), the calibrated input_scale ([]), and KV scales named
    self_attn.k_proj.k_scale / v_proj.v_scale."""
    from jaxllm.loader.safetensors_io import iter_tensors, safetensors_files
    tensors = {}
    for path in safetensors_files(model_dir):
        for name, host in iter_tensors(path):
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                scale = np.float32(np.abs(host).max() / 448)
                tensors[name] = (host / scale).astype(ml_dtypes.float8_e4m3fn)
                base = name.removesuffix(".weight")
                tensors[f"{base}.weight_scale"] = np.asarray(scale)
                tensors[f"{base}.input_scale"] = np.asarray(scales[f"{base}.input_scale"])
            else:
                tensors[name] = np.asarray(host)
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn"
        tensors[f"{prefix}.k_proj.k_scale"] = np.asarray(0.5 + layer, np.float32)
        tensors[f"{prefix}.v_proj.v_scale"] = np.asarray(2.0 - layer, np.float32)
    return tensors


def test_modelopt_fp8_checkpoint_runs_as_the_same_static_fp8_one(tiny_llama_dir, tmp_path):
    """quant_algo FP8 (per-tensor weights, static activations, FP8 KV scales), from config.json
    or from hf_quant_config.json: the same logits as the same tensors under vLLM's fp8 static
    format; its KV scales read from ModelOpt's names."""
    from jaxllm.loader.safetensors_io import write_checkpoint
    tensors = modelopt_tensors(tiny_llama_dir, calibrated_input_scales(tiny_llama_dir, [PROMPT]))
    modelopt = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    fp8 = {"quant_method": "fp8", "activation_scheme": "static"}
    plain = {k: v for k, v in tensors.items() if not k.endswith(("k_scale", "v_scale"))}
    runs = {}
    for name, qconfig, arrays in (("modelopt", modelopt, tensors), ("fp8", fp8, plain)):
        out = write_checkpoint(tiny_llama_dir, str(tmp_path / name), arrays, qconfig)
        loaded = load_model(out, "float32", quantization=name)
        runs[name] = (loaded, logits_of(loaded, fuse_params(loaded.params,
                                                             loaded.args.num_kv_heads), PROMPT))
    np.testing.assert_array_equal(runs["modelopt"][1], runs["fp8"][1])
    loaded = runs["modelopt"][0]
    assert loaded.args.kv_cache_scales and float(loaded.params["layers"][1]["k_scale"]) == 1.5
    assert float(loaded.params["layers"][0]["w_down"].input_scale) > 0
    # NVIDIA's older exports: config.json without quantization_config, hf_quant_config.json
    legacy = write_checkpoint(tiny_llama_dir, str(tmp_path / "legacy"), tensors, None)
    with open(os.path.join(legacy, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.19.0"},
                   "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                    "exclude_modules": ["lm_head"]}}, f)
    config = EngineArgs(model=legacy, kv_cache_dtype="fp8").create_engine_config()
    assert config.model_config.quantization == "modelopt"
    np.testing.assert_array_equal(logits_of(loaded, fuse_params(
        load_model(legacy, "float32", quantization="modelopt").params, loaded.args.num_kv_heads),
        PROMPT), runs["fp8"][1])


def test_modelopt_per_channel_and_block_algorithms_read_their_scales():
    """FP8_PER_CHANNEL_PER_TOKEN: per-channel weights, dynamic activations (input_scale not
    read); FP8_PB_WO: 128 x 128 blocks, scales stored [N / 128, 1, K / 128, 1]."""
    from jaxllm.models.quant import Fp8BlockWeight
    rng = np.random.default_rng(9)
    values = (rng.standard_normal((256, 256)) * 50).astype(ml_dtypes.float8_e4m3fn)
    channel = rng.uniform(0.01, 0.1, 256).astype(np.float32)
    w = build_weight("modelopt", {"weight": values, "weight_scale": channel,
                                  "input_scale": np.float32(0.1)},
                     {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"},
                     jnp.bfloat16)
    assert isinstance(w, Fp8Weight) and w.input_scale is None
    np.testing.assert_allclose(np.asarray(dequantize(w)), values.astype(np.float32).T * channel,
                               rtol=1e-6)
    blocks = rng.uniform(0.01, 0.1, (2, 1, 2, 1)).astype(np.float32)
    w = build_weight("modelopt", {"weight": values, "weight_scale": blocks},
                     {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}, jnp.bfloat16)
    assert isinstance(w, Fp8BlockWeight) and w.group == 128
    np.testing.assert_array_equal(np.asarray(dequantize(w)).T,
                                  block_dequantized(values, blocks[:, 0, :, 0], (128, 128)))


@pytest.mark.parametrize("qconfig,match", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4 is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "INT8_SQ"}, "ModelOpt currently only supports"),
    ({"quant_method": "modelopt"}, "Missing 'quant_algo'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"},
     "kv_cache_quant_algo NVFP4"),
])
def test_unsupported_modelopt_refused_before_loading(qconfig, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=config_with(tmp_path, qconfig)).create_engine_config()
