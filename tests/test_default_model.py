"""The default model (SmolLM2-135M-Instruct from its GGUF): our conversion vs HF transformers
loading the same GGUF with torch, fp32."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loader import load_model
from jaxllm.loader.default_model import default_gguf_path
from jaxllm.models import forward, fuse_params
from jaxllm.worker.batch import SeqChunk, build_step_batch

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Write a haiku about paged attention, naïvely: 日本語 ✓"}],
]
PLAIN = ["Hello, my name is", "  leading spaces\tand tabs\n\nnewlines 1234567 <|im_end|> done"]


@pytest.fixture(scope="module")
def hf_gguf(default_model_dir, tmp_path_factory):
    """HF's own GGUF path, from a directory holding only the GGUF (so nothing of ours leaks in)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_only = tmp_path_factory.mktemp("gguf_only")
    gguf = os.path.basename(default_gguf_path())
    os.symlink(default_gguf_path(), gguf_only / gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf_only, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf_only, gguf_file=gguf, dtype=torch.float32)
    return tokenizer, model


@pytest.fixture(scope="module")
def ours(default_model_dir):
    return load_model(None, "float32")


def test_tokenizer_and_chat_template_match_hf_gguf(ours, hf_gguf):
    hf_tok = hf_gguf[0]
    for chat in CHATS:
        assert (ours.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                == hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        text = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.tokenizer(text).input_ids == hf_tok(text).input_ids
    for text in PLAIN:
        ids = ours.tokenizer(text).input_ids
        assert ids == hf_tok(text).input_ids
        assert ours.tokenizer.decode(ids) == hf_tok.decode(ids)
    assert ours.eos_token_ids == {hf_tok.eos_token_id} == {2}
    assert ours.args.tie_word_embeddings and ours.max_model_len == 8192


def test_chat_prompt_logits_match_hf_gguf(ours, hf_gguf):
    import torch

    hf_tok, hf_model = hf_gguf
    text = hf_tok.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=False)
    ids = hf_tok(text).input_ids
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
    args, block_size = ours.args, 16
    num_blocks = len(ids) // block_size + 2
    batch = build_step_batch([SeqChunk(ids, 0, list(range(1, num_blocks)))], len(ids), 1,
                             num_blocks - 1, block_size)
    shape = (num_blocks, block_size, args.num_kv_heads, args.head_dim)
    kv_caches = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(args.num_layers)]
    logits, _ = jax.jit(forward, static_argnames=("args",))(
        fuse_params(ours.params, args.num_kv_heads), kv_caches, jax.tree.map(jnp.asarray, batch),
        args=args)
    logits = np.asarray(logits[0])
    rel = np.max(np.abs(logits - ref)) / np.max(np.abs(ref))
    assert rel < 1e-3, rel
    assert logits.argmax() == ref.argmax()


def test_gguf_file_path_converts_into_cache(default_model_dir, tmp_path, monkeypatch):
    import filecmp

    from jaxllm.loader.default_model import converted_gguf_dir

    monkeypatch.setenv("JAXLLM_CACHE_DIR", str(tmp_path))
    converted = converted_gguf_dir(default_gguf_path())
    assert converted.startswith(str(tmp_path)) and converted_gguf_dir(default_gguf_path()) == converted
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert filecmp.cmp(os.path.join(converted, name), os.path.join(default_model_dir, name),
                           shallow=False), name


def hf_greedy_until_eos(hf_model, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    import torch

    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(hf_model(torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
    return out


def test_engine_greedy_generation_matches_hf_gguf(default_model_dir, hf_gguf):
    """The whole engine on the default model (chat and plain prompts in one batch) against HF
    transformers' greedy decoding of the same GGUF, token for token."""
    from jaxllm import LLM, SamplingParams

    hf_tok, hf_model = hf_gguf
    prompts = [hf_tok(hf_tok.apply_chat_template(chat, add_generation_prompt=True,
                                                 tokenize=False)).input_ids for chat in CHATS]
    prompts += [hf_tok(text).input_ids for text in PLAIN]
    max_new_tokens = 20
    expected = [hf_greedy_until_eos(hf_model, ids, max_new_tokens, hf_tok.eos_token_id)
                for ids in prompts]
    llm = LLM(default_model_dir, dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, compilation_cache_dir=None)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    first = outputs[0].outputs[0]
    assert first.text == hf_tok.decode(expected[0], skip_special_tokens=True)
    assert "Paris" in first.text
