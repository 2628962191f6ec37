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
from jaxllm.loader.gguf_import import read_metadata, tokenizer_from_metadata
from jaxllm.models import forward, fuse_params
from jaxllm.worker.batch import SeqChunk, build_step_batch

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Write a haiku about paged attention, naïvely: 日本語 ✓"}],
]
PLAIN = ["Hello, my name is", "  leading spaces\tand tabs\n\nnewlines 1234567 <|im_end|> done"]

# Token ids of the tokenizer that transformers' GGUF builder made (5.24, before this import used
# the tokenizers library), for the strings beside them.
REFERENCE_IDS = [
    ('Hello, my name is',
     [19556, 28, 957, 1462, 314]),
    ('  leading spaces\tand tabs\n\nnewlines 1234567 <|im_end|> done',
     [216, 2899, 5600, 197, 397, 29416, 198, 198, 2241, 5110, 216, 33, 34, 35, 36, 37, 38, 39,
      216, 2, 2294]),
    ('The quick brown fox jumps over the lazy dog.',
     [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30]),
    ("I'm sure they'll say it's fine, we've done what you'd've done.",
     [57, 5248, 2090, 502, 3060, 1643, 357, 506, 4979, 28, 392, 3543, 2294, 732, 346, 6737, 3543,
      2294, 30]),
    ('naïve café résumé — “quotes” and ‘single’ …',
     [3546, 46494, 37366, 412, 2756, 5422, 2756, 1841, 619, 385, 2346, 573, 284, 1551, 18536,
      417, 5548]),
    ('日本語のテキストと中文字符，한국어 텍스트',
     [23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226,
      7365, 118, 28589, 29184, 36518, 40562, 116, 12831, 33085, 246, 181, 130, 251, 183, 240,
      129, 48138, 223, 231, 183, 228, 114, 184, 228, 133]),
    ('emoji 🤗🚀👍🏽 and flags 🇫🇷 zwj 👨\u200d👩\u200d👧',
     [391, 33777, 15107, 114, 241, 10813, 244, 218, 10813, 235, 231, 10813, 233, 138, 284, 13198,
      15107, 225, 121, 10813, 225, 132, 1892, 103, 90, 15107, 235, 118, 321, 231, 10813, 235,
      119, 321, 231, 10813, 235, 117]),
    ('def f(x):\n    return x**2  # comment\n\n\tif x != 0: pass',
     [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5189, 1116, 197, 342, 1792,
      6541, 216, 32, 42, 1301]),
    ('numbers 3.14159 2,718 1e-10 0x1F 007 1000000000',
     [28707, 216, 35, 30, 33, 36, 33, 37, 41, 216, 34, 28, 39, 33, 40, 216, 33, 85, 29, 33, 32,
      216, 32, 104, 33, 54, 216, 32, 32, 39, 216, 33, 32, 32, 32, 32, 32, 32, 32, 32, 32]),
    ('<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n',
     [1, 4093, 198, 26843, 2, 198, 1, 520, 9531, 198]),
    ('<|endoftext|><repo_name>x<file_sep><empty_output>',
     [0, 3, 104, 5, 16]),
    ('   ',
     [333]),
    ('',
     []),
    ('a\r\nb\rc\xa0d\u2003e\u200bf',
     [81, 201, 198, 82, 201, 83, 15442, 84, 321, 221, 85, 321, 229, 86]),
    ('URL https://example.com/path?q=1&r=two#frag and email a.b@c.org',
     [14492, 5141, 1742, 7434, 30, 824, 31, 1537, 47, 97, 45, 33, 22, 98, 45, 11355, 19, 28082,
      284, 4106, 253, 30, 82, 48, 83, 30, 2295]),
    ('ALLCAPS Mixed camelCase snake_case kebab-case',
     [12631, 33467, 67, 34326, 32782, 10802, 14321, 79, 7544, 902, 82, 369, 29, 7544]),
    ('العربية עברית Ελληνικά русский',
     [22208, 34966, 20602, 31462, 23339, 43463, 12960, 112, 37657, 30825, 28532, 120, 5664, 239,
      17162, 17162, 25723, 11517, 12001, 21118, 26112, 216, 9175, 14714, 9382, 39511, 7872,
      24958]),
    ('\x00\x01 control \x7f bytes',
     [190, 191, 1533, 216, 217, 15590]),
    ('repeated!!!!!! ????? ...... ------',
     [257, 30773, 36689, 10095, 9148, 16693, 16693, 32543, 950, 216, 21771]),
    (' leading space and trailing space ',
     [2899, 1898, 284, 35079, 1898, 216]),
]
CHAT_REFERENCE = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi ✓<|im_end|>\n"
                  "<|im_start|>assistant\n")


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
def gguf_tokenizer(default_model_dir, tmp_path_factory):
    """This checkout's tokenizer from the default GGUF's metadata, saved and loaded back as the
    engine loads it (the cached conversion may predate this code)."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("gguf_tokenizer")
    tokenizer_from_metadata(read_metadata(GGUFReader(default_gguf_path()))).save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def test_gguf_tokenizer_matches_the_recorded_ids(gguf_tokenizer):
    for text, ids in REFERENCE_IDS:
        assert gguf_tokenizer(text).input_ids == ids, text
        assert gguf_tokenizer.decode(ids) == text
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi ✓"}]
    assert gguf_tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                              tokenize=False) == CHAT_REFERENCE
    assert (gguf_tokenizer.bos_token, gguf_tokenizer.eos_token, gguf_tokenizer.unk_token,
            gguf_tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>",
                                          "<|im_end|>")
    assert gguf_tokenizer.eos_token_id == 2 and len(gguf_tokenizer) == 49152


def test_gguf_tokenizer_splits_digits_as_llama_cpp(gguf_tokenizer):
    """tokenizer.ggml.pre "smollm": llama.cpp splits every digit off before GPT-2's split (as
    SmolLM2's own tokenizer does), so spaces before a digit stay one run. transformers' GGUF
    builder ignored "smollm" and gave [49, 216, 216, 35] here."""
    assert gguf_tokenizer("A  3").input_ids == [49, 256, 35]
    assert gguf_tokenizer("x 12").input_ids == gguf_tokenizer("x").input_ids + [216, 33, 34]


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
    shape = (num_blocks, args.num_kv_heads, block_size, args.head_dim)
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
    """HF's greedy decoding (its generate, with its KV cache): the new tokens, EOS included."""
    import torch

    with torch.no_grad():
        prompt = torch.tensor([ids])
        out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=eos,
                                pad_token_id=eos)
    return out[0, len(ids):].tolist()


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


def test_ngram_speculation_on_the_default_model_equals_hf_greedy(default_model_dir, hf_gguf):
    """n-gram speculation (k = 4) on the default model's real weights: greedy tokens equal HF
    transformers' greedy decoding of the GGUF, with drafts accepted along the way (a prompt whose
    answer repeats it)."""
    from jaxllm import LLM, SamplingParams

    hf_tok, hf_model = hf_gguf
    passage = "The cat sat on the mat. The dog sat on the log. The bird sat on the branch."
    chats = CHATS[:1] + [[{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]]
    prompts = [hf_tok(hf_tok.apply_chat_template(chat, add_generation_prompt=True,
                                                 tokenize=False)).input_ids for chat in chats]
    max_new_tokens = 24
    expected = [hf_greedy_until_eos(hf_model, ids, max_new_tokens, hf_tok.eos_token_id)
                for ids in prompts]
    llm = LLM(default_model_dir, dtype="float32", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, compilation_cache_dir=None,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new_tokens),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens_total"] >= 8
