"""MoE models (Mixtral, Qwen3-MoE, Qwen2-MoE) loaded from tiny random HF checkpoints vs HF
transformers (torch, fp32) logits; routing and grouped experts vs a dense per-expert reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import save_random_checkpoint
from jaxllm.loader import load_model
from jaxllm.models import forward, fuse_params
from jaxllm.models import moe
from jaxllm.models.moe import grouped_experts, route
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_swiglu
from jaxllm.worker.batch import SeqChunk, build_step_batch
from jaxllm.worker.kv_cache import allocate_kv_caches

_BASE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MOE_CONFIGS = {
    "mixtral": dict(_BASE, model_type="mixtral", architectures=["MixtralForCausalLM"],
                    intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    # layer 0 is dense (mlp_only_layers), layer 1 sparse; top-4 of 8 renormalised
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                      head_dim=16, intermediate_size=40, moe_intermediate_size=24, num_experts=8,
                      num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[0]),
    # top-2 of 4 not renormalised, plus the sigmoid-gated shared expert
    "qwen2_moe": dict(_BASE, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                      intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=False,
                      shared_expert_intermediate_size=56),
}


def save_tiny_moe(kind: str, out_dir: str, seed: int = 0) -> str:
    return save_random_checkpoint(MOE_CONFIGS[kind], out_dir, seed=seed)


def _hf_logits(model_dir: str, token_ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()  # [L, V]


@pytest.mark.parametrize("kind", sorted(MOE_CONFIGS))
def test_moe_prefill_matches_hf(kind, tmp_path):
    model_dir = save_tiny_moe(kind, str(tmp_path / kind), seed=len(kind))
    loaded = load_model(model_dir, dtype="float32")
    assert loaded.args.mlp_kind == "moe"
    token_ids = np.random.default_rng(0).integers(3, 96, size=11).tolist()
    caches = allocate_kv_caches(loaded.args.num_layers, 8, 4, loaded.args.num_kv_heads,
                                loaded.args.head_dim, jnp.float32)
    batch = build_step_batch([SeqChunk(token_ids, 0, [1, 2, 3])], 16, 2, 4, 4)
    batch = dataclasses.replace(batch, logits_indices=np.arange(11, dtype=np.int32))
    step = jax.jit(forward, static_argnames=("args",))
    params = fuse_params(loaded.params, loaded.args.num_kv_heads)
    logits, _ = step(params, caches, jax.tree.map(jnp.asarray, batch), args=loaded.args)
    ref = _hf_logits(model_dir, token_ids)
    err = float(np.max(np.abs(np.asarray(logits) - ref)) / np.max(np.abs(ref)))
    assert err < 1e-4, f"{kind}: relative error {err}"


@pytest.mark.parametrize("matmul", ["ragged_dot", "pallas"])
def test_grouped_experts_match_dense_reference(matmul, monkeypatch):
    """Grouped matmuls over expert-sorted pairs (XLA's ragged_dot, as on CPU, or the Pallas
    kernel a GPU runs, here interpreted) == each token through its k experts, one by one; and
    the experts split in halves (EP's local compute) sum to the whole."""
    if matmul == "pallas":
        monkeypatch.setattr(moe, "_grouped_matmul",
                            lambda x, w, sizes: grouped_matmul(x, w, sizes, interpret=True))
        monkeypatch.setattr(moe, "_grouped_swiglu", lambda x, wg, wu, sizes: grouped_swiglu(
            x, wg, wu, sizes, interpret=True))
    rng = np.random.default_rng(1)
    num_tokens, hidden, inter, num_experts, top_k = 7, 8, 6, 4, 3
    x = jnp.asarray(rng.normal(size=(num_tokens, hidden)), jnp.float32)
    router = jnp.asarray(rng.normal(size=(hidden, num_experts)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(num_experts, hidden, inter)), jnp.float32)
                    for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(num_experts, inter, hidden)), jnp.float32)
    args = type("A", (), {"num_experts_per_tok": top_k, "norm_topk_prob": True})()
    weights, experts = route(x, router, args)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    out = grouped_experts(x, weights, experts, w_gate, w_up, w_down, 0)
    ref = np.zeros((num_tokens, hidden), np.float32)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(experts[t, j])
            h = jax.nn.silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])
            ref[t] += float(weights[t, j]) * np.asarray(h @ w_down[e])
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    halves = sum(grouped_experts(x, weights, experts, w_gate[s:s + 2], w_up[s:s + 2],
                                 w_down[s:s + 2], s) for s in (0, 2))
    np.testing.assert_allclose(np.asarray(halves), ref, rtol=1e-5, atol=1e-5)
