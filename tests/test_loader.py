"""load_model: HF directories (single and sharded safetensors), dtypes, tied weights, EOS ids,
dummy weights, placement with shardings, bad input; GGUF Q/K permutation."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from jaxllm.loader import load_model
from jaxllm.loader.gguf_import import unpermute_rows
from jaxllm.loader.safetensors_io import iter_tensors
from jaxllm.models import ModelArgs
from jaxllm.models.presets import PRESETS


def _hf_tensors(model_dir: str) -> dict[str, np.ndarray]:
    return {n: np.array(t) for n, t in iter_tensors(os.path.join(model_dir, "model.safetensors"))}


def test_weights_mapped_and_transposed(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir, "float32")
    hf = _hf_tensors(tiny_llama_dir)
    layer = loaded.params["layers"][1]
    np.testing.assert_array_equal(layer["wq"], hf["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(layer["w_down"], hf["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(layer["mlp_norm"], hf["model.layers.1.post_attention_layernorm.weight"])
    np.testing.assert_array_equal(loaded.params["lm_head"], hf["lm_head.weight"].T)
    assert loaded.params["embed"].dtype == jnp.float32
    assert loaded.eos_token_ids == {2} and loaded.max_model_len == 512
    assert loaded.tokenizer("Hello world").input_ids  # the checkpoint's tokenizer came along


def test_tied_embeddings_have_no_lm_head(tiny_qwen2_dir):
    loaded = load_model(tiny_qwen2_dir, "float32")
    assert "lm_head" not in loaded.params and "bq" in loaded.params["layers"][0]


def test_bfloat16_load(tiny_qwen3_dir):
    loaded = load_model(tiny_qwen3_dir, "bfloat16")
    hf = _hf_tensors(tiny_qwen3_dir)
    leaves = jax.tree.leaves(loaded.params)
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(loaded.params["layers"][0]["k_norm"],
                                  hf["model.layers.0.self_attn.k_norm.weight"].astype(ml_dtypes.bfloat16))


def test_sharded_checkpoint_and_generation_config_eos(tiny_llama_dir, tmp_path):
    """Split the checkpoint over two files with an index; EOS ids merged from generation_config."""
    for name in os.listdir(tiny_llama_dir):
        if name != "model.safetensors":
            shutil.copy(os.path.join(tiny_llama_dir, name), tmp_path / name)
    tensors = _hf_tensors(tiny_llama_dir)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / file))
    weight_map = {n: file for file, members in shards.items() for n in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    sharded, single = load_model(str(tmp_path), "float32"), load_model(tiny_llama_dir, "float32")
    for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params), strict=True):
        np.testing.assert_array_equal(a, b)
    assert sharded.eos_token_ids == {2, 7}


def test_placement_follows_shardings(tiny_llama_dir):
    mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
    col = NamedSharding(mesh, PartitionSpec(None, "tp"))
    rep = NamedSharding(mesh, PartitionSpec())
    loaded = load_model(tiny_llama_dir, "float32", shardings=lambda p: col if p.endswith("wq") else rep)
    assert loaded.params["layers"][0]["wq"].sharding == col
    assert loaded.params["final_norm"].sharding == rep
    hf = _hf_tensors(tiny_llama_dir)
    np.testing.assert_array_equal(loaded.params["layers"][0]["wq"],
                                  hf["model.layers.0.self_attn.q_proj.weight"].T)


def test_dummy_weights_from_config_alone(tiny_llama_dir, tmp_path):
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), tmp_path / "config.json")
    a = load_model(str(tmp_path), "float32", load_format="dummy", seed=3)
    b = load_model(str(tmp_path), "float32", load_format="dummy", seed=3)
    c = load_model(str(tmp_path), "float32", load_format="dummy", seed=4)
    wq = np.asarray(a.params["layers"][0]["wq"])
    assert wq.shape == (64, 64) and 0.015 < wq.std() < 0.025
    np.testing.assert_array_equal(wq, b.params["layers"][0]["wq"])
    assert not np.array_equal(wq, c.params["layers"][0]["wq"])
    assert not np.array_equal(wq, a.params["layers"][1]["wq"])
    assert a.tokenizer is None


def test_presets():
    llama8b = ModelArgs.from_hf_config(PRESETS["llama-3.1-8b"])
    assert (llama8b.num_layers, llama8b.num_kv_heads, llama8b.rope_type) == (32, 8, "llama3")
    assert ModelArgs.from_hf_config(PRESETS["qwen3-8b"]).qk_norm
    assert ModelArgs.from_hf_config(PRESETS["llama-3.1-70b"]).hidden_size == 8192
    qwen3_moe = ModelArgs.from_hf_config(PRESETS["qwen3-30b-a3b"])
    assert (qwen3_moe.mlp_kind, qwen3_moe.num_experts, qwen3_moe.num_experts_per_tok) == ("moe", 128, 8)
    mixtral = ModelArgs.from_hf_config(PRESETS["mixtral-8x7b"])
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)


def test_bad_model_inputs(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"), "float32")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="BertModel.*Qwen3ForCausalLM"):
        load_model(str(tmp_path), "float32")
    with pytest.raises(ValueError, match="load_format"):
        load_model(str(tmp_path), "float32", load_format="pt")
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tmp_path), "int8")


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.mark.parametrize("num_heads", [1, 3, 4])
def test_unpermute_inverts_llama_cpp(num_heads):
    weight = np.random.default_rng(num_heads).standard_normal((num_heads * 8, 5))
    permuted = _llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rows(permuted, num_heads), weight)
