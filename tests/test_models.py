"""Our forward over a ragged paged batch vs HF transformers (fp32) on tiny random checkpoints."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loader import load_model
from jaxllm.models import ModelArgs, forward, fuse_params
from jaxllm.models.attention import RopeKVWrite
from jaxllm.worker.batch import SeqChunk, build_step_batch
from pallas_kernels.kv_write import write_kv_reference

BLOCK_SIZE = 4
NUM_BLOCKS = 40
MAX_BLOCKS_PER_SEQ = 8
PROMPT_LENS = [5, 13, 1, 9]
STEP2_LENS = [1, 3, 2, 1]  # decode steps and a continued chunk, in one batch


def _hf_logits(model_dir: str, token_ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].numpy()  # [L, V]


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _run_step(loaded, kv_caches, chunks, all_positions: bool, write_kv=write_kv_reference):
    batch = build_step_batch(chunks, 32, 8, MAX_BLOCKS_PER_SEQ, BLOCK_SIZE)
    num_tokens = sum(len(c.token_ids) for c in chunks)
    if all_positions:  # logits at every real token, not only each sequence's last
        batch = dataclasses.replace(batch, logits_indices=np.arange(num_tokens, dtype=np.int32))
    step = jax.jit(functools.partial(forward, write_kv=write_kv), static_argnames=("args",))
    params = fuse_params(loaded.params, loaded.args.num_kv_heads)
    logits, kv_caches = step(params, kv_caches, jax.tree.map(jnp.asarray, batch), args=loaded.args)
    return np.asarray(logits), kv_caches


@pytest.mark.parametrize("kind,write_kv", [
    ("llama", write_kv_reference), ("qwen2", write_kv_reference), ("qwen3", write_kv_reference),
    # the Pallas backends' rope and KV write, one kernel (interpret mode); qwen3's q/k norms
    # take the unfused path
    ("llama", RopeKVWrite(interpret=True)), ("qwen2", RopeKVWrite(interpret=True))])
def test_prefill_then_continue_matches_hf(kind, write_kv, tiny_model_dirs):
    model_dir = tiny_model_dirs[kind]
    loaded = load_model(model_dir, "float32")
    args = loaded.args
    rng = np.random.default_rng(0)
    vocab = args.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]
    # each sequence owns a random, non-contiguous set of blocks (block 0 is padding's)
    perm = rng.permutation(np.arange(1, NUM_BLOCKS))
    tables = [perm[i * MAX_BLOCKS_PER_SEQ:(i + 1) * MAX_BLOCKS_PER_SEQ].tolist()
              for i in range(len(prompts))]
    shape = (NUM_BLOCKS, args.num_kv_heads, BLOCK_SIZE, args.head_dim)
    kv_caches = [(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
                 for _ in range(args.num_layers)]

    chunks = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)]
    logits, kv_caches = _run_step(loaded, kv_caches, chunks, all_positions=True,
                                  write_kv=write_kv)
    ref = np.concatenate([_hf_logits(model_dir, p) for p in prompts])
    assert logits.shape == ref.shape
    assert _rel_err(logits, ref) < 1e-4, _rel_err(logits, ref)

    extra = [rng.integers(3, vocab, n).tolist() for n in STEP2_LENS]
    chunks = [SeqChunk(e, len(p), t) for p, e, t in zip(prompts, extra, tables)]
    logits, _ = _run_step(loaded, kv_caches, chunks, all_positions=False, write_kv=write_kv)
    ref = np.stack([_hf_logits(model_dir, p + e)[-1] for p, e in zip(prompts, extra)])
    assert _rel_err(logits[:len(prompts)], ref) < 1e-4, _rel_err(logits[:len(prompts)], ref)


def test_model_args_from_configs(tiny_model_dirs):
    import json

    read = lambda k: json.load(open(f"{tiny_model_dirs[k]}/config.json"))
    llama, qwen2, qwen3 = (ModelArgs.from_hf_config(read(k)) for k in ("llama", "qwen2", "qwen3"))
    assert (llama.rope_type, llama.rope_factor, llama.rope_original_max_position) == ("llama3", 8.0, 64)
    assert (llama.num_kv_heads, llama.qkv_bias, llama.tie_word_embeddings) == (2, False, False)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings) == (True, False, True)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.q_size) == (True, 32, 128)
    assert hash(qwen3) == hash(ModelArgs.from_hf_config(read("qwen3")))


def test_unsupported_architecture_names_it():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelArgs.from_hf_config({"architectures": ["GPT2LMHeadModel"]})


def test_fused_projections_equal_the_separate_ones():
    """fuse_params' wqkv / bqkv / w_gate_up give, in one GEMM each, exactly the q, k, v and
    gate, up of the HF-shaped matrices (query head i grouped with KV head i // G), and the
    fused-away matrices are deleted only when asked."""
    from jaxllm.models.transformer import _qkv, _split_qkv

    rng = np.random.default_rng(0)
    hidden, num_heads, num_kv_heads, head_dim, inter = 16, 6, 2, 4, 10
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    layer = dict(wq=normal(hidden, num_heads * head_dim), wk=normal(hidden, num_kv_heads * head_dim),
                 wv=normal(hidden, num_kv_heads * head_dim), bq=normal(num_heads * head_dim),
                 bk=normal(num_kv_heads * head_dim), bv=normal(num_kv_heads * head_dim),
                 w_gate=normal(hidden, inter), w_up=normal(hidden, inter), wo=normal(4, 4))
    args = type("A", (), dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim))
    fused = fuse_params({"layers": [layer]}, num_kv_heads)["layers"][0]
    assert sorted(fused) == ["bqkv", "w_gate_up", "wo", "wqkv"]
    h = normal(3, hidden)
    q, k, v = _split_qkv(_qkv(fused, h, args), args)
    np.testing.assert_allclose(q, (h @ layer["wq"] + layer["bq"]).reshape(3, num_heads, head_dim),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k, (h @ layer["wk"] + layer["bk"]).reshape(3, num_kv_heads, -1),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, (h @ layer["wv"] + layer["bv"]).reshape(3, num_kv_heads, -1),
                               rtol=1e-5, atol=1e-5)
    gate_up = jnp.einsum("th,hci->tci", h, fused["w_gate_up"])
    np.testing.assert_allclose(gate_up[:, 0], h @ layer["w_gate"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate_up[:, 1], h @ layer["w_up"], rtol=1e-5, atol=1e-5)
    assert not layer["wq"].is_deleted()
    fuse_params({"layers": [layer]}, num_kv_heads, free_inputs=True)
    assert layer["wq"].is_deleted() and not layer["wo"].is_deleted()
