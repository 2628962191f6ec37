"""GGUF (llama.cpp) -> HF directory, without torch.

Every tensor is dequantised to float32 with the `gguf` package; llama.cpp's row permutation of
Q and K (interleaved rotary pairs) is undone so HF's half-split rope applies; the tokenizer and
chat template are rebuilt from the GGUF metadata with transformers' GGUF tokenizer builders.
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
# GGUF key (under tokenizer.) -> transformers' name, as transformers' own GGUF tokenizer path
_TOKENIZER_KEYS = {"ggml.model": "tokenizer_type", "ggml.pre": "pre_tokenizer_type",
                   "ggml.tokens": "tokens", "ggml.scores": "scores", "ggml.token_type": "token_type",
                   "ggml.merges": "merges", "ggml.add_space_prefix": "add_prefix_space"}
_TOKENIZER_CONFIG_KEYS = {"chat_template": "chat_template", "ggml.add_bos_token": "add_bos_token",
                          "ggml.add_eos_token": "add_eos_token"}
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                   "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


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
    """A PreTrainedTokenizerFast as `from_pretrained(dir, gguf_file=...)` builds it, minus torch."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokenizer_dict = {ours: meta[f"tokenizer.{key}"] for key, ours in _TOKENIZER_KEYS.items()
                      if f"tokenizer.{key}" in meta}
    config = {ours: meta[f"tokenizer.{key}"] for key, ours in _TOKENIZER_CONFIG_KEYS.items()
              if f"tokenizer.{key}" in meta}
    if tokenizer_dict.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


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
