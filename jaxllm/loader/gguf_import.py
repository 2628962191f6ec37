"""GGUF (llama.cpp) -> HF directory, without torch.

Every tensor is dequantised to float32 with the `gguf` package; llama.cpp's row permutation of
Q and K (interleaved rotary pairs) is undone so HF's half-split rope applies; the tokenizer is
rebuilt from the GGUF metadata with the `tokenizers` library (the byte-level BPE of `gpt2`-type
vocabularies, split as llama.cpp splits for the file's `tokenizer.ggml.pre`) and saved, with the
chat template, through transformers' public PreTrainedTokenizerFast.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
from tqdm.auto import tqdm

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
# llama.cpp's pre-tokenizer splits (llama-vocab.cpp) by tokenizer.ggml.pre; GPT-2's own split is
# ByteLevel's built-in regex.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT2_PRE = ("default", "gpt2", "gpt-2")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                         "minerva")
_REGEX_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def read_metadata(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def hf_config_from_metadata(meta: dict, tied: bool) -> dict:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: ['llama'].")
    get = lambda key, default=None: meta.get(f"llama.{key}", default)
    hidden, heads = get("embedding_length"), get("attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows (pairs interleaved) -> (halves)."""
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
            .reshape(weight.shape))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError("GGUF files with rope_freqs (llama3 rope scaling) are not supported.")
    raise ValueError(f"Unexpected GGUF tensor {gguf_name!r}.")


def dequantized_tensors(reader, config: dict) -> dict[str, np.ndarray]:
    """HF name -> float32 [out, in] array, Q/K rows back in HF order."""
    from gguf.quants import dequantize

    heads = {"self_attn.q_proj.weight": config["num_attention_heads"],
             "self_attn.k_proj.weight": config["num_key_value_heads"]}
    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Dequantising GGUF", unit="tensor", disable=None):
        name = _hf_name(tensor.name)
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
        suffix = name.split(".", 3)[-1]
        if suffix in heads:
            weight = unpermute_rows(weight, heads[suffix])
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def tokenizer_from_metadata(meta: dict):
    """A PreTrainedTokenizerFast with the GGUF's vocabulary, merges, special tokens, BOS/EOS
    rules and chat template. Byte-level BPE (`tokenizer.ggml.model` gpt2) only."""
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (supported: ['gpt2'], "
                         f"byte-level BPE); pass the model's HF directory instead.")
    tokens = meta["tokenizer.ggml.tokens"]
    config = {name: tokens[meta[f"tokenizer.ggml.{key}"]] if f"tokenizer.ggml.{key}" in meta
              else None for name, key in _SPECIAL_TOKENS.items()}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend = _byte_level_bpe(meta)
    backend.post_processor = _bos_eos_processor(config, meta, add_bos, add_eos)
    return PreTrainedTokenizerFast(tokenizer_object=backend, add_bos_token=add_bos,
                                   add_eos_token=add_eos,
                                   chat_template=meta.get("tokenizer.chat_template"), **config)


def _byte_level_bpe(meta: dict):
    """tokenizers' BPE over the file's vocabulary and merges, with control tokens special and
    user-defined ones matched whole, as llama.cpp treats them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges,
                                   fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would
    # add a token id past the model's vocabulary.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types)
                                if kind == _CONTROL and set(t) <= byte_alphabet])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    return backend


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = sorted(_GPT2_PRE + _DIGITS_THEN_GPT2_PRE + tuple(_REGEX_PRE))
    raise ValueError(f"GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} is not supported (supported: "
                     f"{supported}); pass the model's HF directory instead.")


def _bos_eos_processor(config: dict, meta: dict, add_bos: bool, add_eos: bool):
    from tokenizers import processors

    bos, eos = config["bos_token"], config["eos_token"]
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise ValueError("The GGUF asks for a BOS/EOS token it does not name.")
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    special = {t: meta[f"tokenizer.ggml.{key}_token_id"] for t, key, on in
               ((bos, "bos", add_bos), (eos, "eos", add_eos)) if on}
    return processors.TemplateProcessing(single=single, pair=pair,
                                         special_tokens=list(special.items()))


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Writes config.json, model.safetensors (float32), tokenizer files, generation_config.json."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    if not os.path.isfile(gguf_path):
        raise ValueError(f"GGUF file {gguf_path!r} does not exist.")
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = hf_config_from_metadata(meta, tied)
    tensors = dequantized_tensors(reader, config)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tokenizer_from_metadata(meta).save_pretrained(out_dir)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    for name, content in (("config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)
    return out_dir
