"""PEFT LoRA adapters: loading against PEFT's own merge, every refusal with its message, and the
host-side LRU."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllm.lora.host_cache import HostLoRACache
from jaxllm.lora.peft import LORA_TARGETS, load_peft_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.models.args import ModelArgs
from lora_fixtures import peft_merged_weights, save_random_peft_adapter

ALL = list(LORA_TARGETS)
_PARENT = {t: "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
           for t in LORA_TARGETS}
# (base, rank, target_modules, lora_alpha, use_rslora, rank_pattern, alpha_pattern)
MERGE_CASES = {
    "llama-r8-all": ("llama", 8, ALL, 16, False, None, None),
    "llama-r4-qv": ("llama", 4, ["q_proj", "v_proj"], 8, False, None, None),
    "llama-r2-regex-layer1-mlp": ("llama", 2, r".*\.layers\.1\.mlp\.(gate|down)_proj", 5, False,
                                  None, None),
    "qwen3-r16-all-linear-rslora": ("qwen3", 16, "all-linear", 32, True, None, None),
    "qwen3-patterns": ("qwen3", 8, ALL, 16, False, {"q_proj": 4, "down_proj": 12},
                       {"layers.1.mlp.up_proj": 3.0, "v_proj": 40.0}),
}


def _args(model_dir: str) -> ModelArgs:
    with open(os.path.join(model_dir, "config.json")) as f:
        return ModelArgs.from_hf_config(json.load(f))


@pytest.fixture(scope="module")
def bases(tiny_llama_dir, tiny_qwen3_dir) -> dict[str, str]:
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}


@pytest.fixture(scope="module")
def adapters(bases, tmp_path_factory) -> dict[str, str]:
    """case -> the adapter directory PEFT saved."""
    out = {}
    for seed, (case, (base, rank, targets, alpha, rslora, ranks, alphas)) in enumerate(
            MERGE_CASES.items()):
        out[case] = save_random_peft_adapter(
            bases[base], str(tmp_path_factory.mktemp(case)), rank=rank, target_modules=targets,
            lora_alpha=alpha, use_rslora=rslora, seed=seed, rank_pattern=ranks,
            alpha_pattern=alphas)
    return out


@pytest.fixture
def llama_adapter(adapters, tmp_path) -> str:
    """A copy of the rank-8 all-module Llama adapter, free to edit."""
    return shutil.copytree(adapters["llama-r8-all"], tmp_path / "edited")


def _hf_weight_name(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{_PARENT[target]}.{target}.weight"


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_w_plus_a_b_equals_peft_merge(case, bases, adapters):
    """W + A @ B from the loaded adapter equals the weight PEFT's merge_and_unload makes, module by
    module; modules the adapter leaves alone are absent and unchanged by PEFT too."""
    base_dir = bases[MERGE_CASES[case][0]]
    args = _args(base_dir)
    adapter = load_peft_adapter(adapters[case], args, max_lora_rank=16)
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    merged = peft_merged_weights(base_dir, adapters[case])
    touched = 0
    for layer in range(args.num_layers):
        for target in LORA_TARGETS:
            name = _hf_weight_name(layer, target)
            if target in adapter.layers[layer]:
                a, b = adapter.layers[layer][target]
                assert a.dtype == b.dtype == np.float32
                np.testing.assert_allclose(base[name].T + a @ b, merged[name].T, atol=1e-5,
                                           rtol=0, err_msg=name)
                touched += 1
            else:
                np.testing.assert_array_equal(base[name], merged[name], err_msg=name)
    assert touched > 0
    changed = sum(not np.array_equal(base[n], merged[n]) for n in base)
    assert changed == touched  # PEFT changed exactly the modules the adapter holds


def test_loaded_adapter_fields(adapters, bases):
    args = _args(bases["llama"])
    qv = load_peft_adapter(adapters["llama-r4-qv"], args, max_lora_rank=8, name="qv")
    assert qv.name == "qv" and qv.rank == 4 and len(qv.layers) == args.num_layers
    assert all(sorted(layer) == ["q_proj", "v_proj"] for layer in qv.layers)
    a, b = qv.layers[0]["v_proj"]
    assert a.shape == (args.hidden_size, 4) and b.shape == (4, args.kv_size)
    assert qv.nbytes == sum(x.nbytes for layer in qv.layers for ab in layer.values() for x in ab)
    only = load_peft_adapter(adapters["llama-r2-regex-layer1-mlp"], args, max_lora_rank=8)
    assert only.layers[0] == {} and sorted(only.layers[1]) == ["down_proj", "gate_proj"]
    assert only.name == os.path.basename(adapters["llama-r2-regex-layer1-mlp"])
    patterned = load_peft_adapter(adapters["qwen3-patterns"], _args(bases["qwen3"]),
                                  max_lora_rank=16)
    assert patterned.rank == 12 and patterned.layers[1]["q_proj"][0].shape[1] == 4


def test_bfloat16_and_default_named_keys_load_the_same(llama_adapter, bases):
    """Weights saved in bfloat16, and keys in the `.lora_A.default.weight` form, give the same
    adapter (bfloat16: to its rounding)."""
    args = _args(bases["llama"])
    reference = load_peft_adapter(str(llama_adapter), args, max_lora_rank=8)
    weights = os.path.join(llama_adapter, "adapter_model.safetensors")
    import ml_dtypes
    tensors = load_file(weights)
    save_file({k.replace(".weight", ".default.weight"): v.astype(ml_dtypes.bfloat16)
               for k, v in tensors.items()}, weights)
    loaded = load_peft_adapter(str(llama_adapter), args, max_lora_rank=8)
    for ref_layer, layer in zip(reference.layers, loaded.layers):
        assert sorted(ref_layer) == sorted(layer)
        for target, (a, b) in layer.items():
            np.testing.assert_allclose(a, ref_layer[target][0], rtol=1e-2)
            np.testing.assert_allclose(b, ref_layer[target][1], rtol=1e-2)
            assert not np.array_equal(a, ref_layer[target][0])  # bf16 did round


def _edit_config(adapter_dir, **fields):
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(fields)
    with open(path, "w") as f:
        json.dump(config, f)


def _edit_weights(adapter_dir, edit):
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    save_file(edit(dict(load_file(path))), path)


def _refused(adapter_dir, args, match, max_lora_rank=16):
    with pytest.raises(ValueError, match=match) as info:
        load_peft_adapter(str(adapter_dir), args, max_lora_rank=max_lora_rank)
    assert str(adapter_dir) in str(info.value)  # every refusal names the adapter
    return str(info.value)


@pytest.mark.parametrize("fields, match", [
    ({"r": 64}, "LoRA rank 64 is greater than max_lora_rank 16"),
    ({"use_dora": True}, r"DoRA \(use_dora\) is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ({"modules_to_save": ["lm_head"]}, r"modules_to_save .* is not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"lora_bias": True}, "lora_bias"),
    ({"layer_replication": [[0, 2]]}, "layer_replication"),
    ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "target_parameters"),
    ({"use_qalora": True}, "QA-LoRA"),
    ({"alora_invocation_tokens": [5]}, "alora_invocation_tokens"),
    ({"init_lora_weights": "pissa_niter_4"}, "residual base model"),
    ({"init_lora_weights": "olora"}, "residual base model"),
    ({"peft_type": "LOHA"}, "peft_type 'LOHA' is not supported"),
    ({"a_future_field": {"x": 1}}, r"\['a_future_field'\] are not known"),
    ({"lora_alpha": 0}, "lora_alpha must be a positive number"),
])
def test_config_refusals(fields, match, llama_adapter, bases):
    _edit_config(llama_adapter, **fields)
    _refused(llama_adapter, _args(bases["llama"]), match)


def test_harmless_config_fields_are_accepted(llama_adapter, bases):
    _edit_config(llama_adapter, lora_dropout=0.1, init_lora_weights="gaussian",
                 layers_to_transform=[0, 1], task_type="CAUSAL_LM", a_future_field=None)
    load_peft_adapter(str(llama_adapter), _args(bases["llama"]), max_lora_rank=8)


def test_rank_above_max_lora_rank(adapters, bases):
    _refused(adapters["llama-r8-all"], _args(bases["llama"]),
             "LoRA rank 8 is greater than max_lora_rank 4", max_lora_rank=4)
    _refused(adapters["qwen3-patterns"], _args(bases["qwen3"]),  # the down_proj pattern's 12
             r"LoRA rank 12 is greater than max_lora_rank 8 .*down_proj", max_lora_rank=8)


def _rename_layer(tensors, old, new):
    return {k.replace(f".layers.{old}.", f".layers.{new}."): v for k, v in tensors.items()}


def _replace(key_from, key_to):
    return lambda tensors: {k.replace(key_from, key_to): v for k, v in tensors.items()}


Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("edit, match", [
    (lambda t: {**t, Q_B: np.zeros((65, 8), np.float32)},
     r"lora_B of q_proj of layer 0 has shape \(65, 8\), expected \(64, 8\)"),
    (lambda t: {**t, Q_B.replace("lora_B", "lora_A"): np.zeros((8, 63), np.float32)},
     r"lora_A of q_proj of layer 0 has shape \(8, 63\), expected \(8, 64\)"),
    (lambda t: _rename_layer(t, 1, 5), r"model\.layers\.5\..* is beyond the base model, which has "
                                       "2 layers"),
    (_replace("layers.0.mlp.gate_proj", "layers.0.mlp.experts.3.gate_proj"),
     r"target module model\.layers\.0\.mlp\.experts\.3\.gate_proj is not supported: MoE experts"),
    (_replace("layers.0.self_attn.q_proj", "layers.0.mlp.q_proj"),
     r"target module model\.layers\.0\.mlp\.q_proj is not supported"),
    (_replace("layers.0.mlp.up_proj", "layers.0.mlp.shared_expert_gate"),
     r"target module model\.layers\.0\.mlp\.shared_expert_gate is not supported"),
    (lambda t: {k: v for k, v in t.items() if k != Q_B}, r"q_proj has no lora_B weight"),
    (lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector":
                np.ones(64, np.float32)},
     r"tensors \['.*q_proj.lora_magnitude_vector'\] are not supported"),
    (_replace("model.layers.0.self_attn.q_proj", "lm_head"),
     r"target module lm_head is not supported"),
    (lambda t: {}, "has no lora_A/lora_B weights"),
])
def test_weight_refusals(edit, match, llama_adapter, bases):
    _edit_weights(llama_adapter, edit)
    _refused(llama_adapter, _args(bases["llama"]), match)


@pytest.mark.parametrize("target, match", [
    ("lm_head", r"tensors \[.*'base_model\.model\.lm_head\.base_layer\.weight'.* are not "
                "supported"),
    ("embed_tokens", r"tensors \[.*embed_tokens.lora_embedding_A.* are not supported"),
])
def test_peft_adapters_on_unsupported_modules(target, match, bases, tmp_path):
    adapter = save_random_peft_adapter(bases["llama"], str(tmp_path / target), rank=4,
                                       target_modules=["q_proj", target], lora_alpha=8)
    _refused(adapter, _args(bases["llama"]), match)


def test_mlp_lora_on_a_moe_layer(adapters, bases):
    moe = dataclasses.replace(_args(bases["llama"]), mlp_kind="moe", num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, dense_layers=(1,))
    _refused(adapters["llama-r8-all"], moe,
             r"model\.layers\.0\.mlp\.(gate|up|down)_proj is not supported: layer 0's MLP is a "
             "mixture of experts")


def test_missing_files(llama_adapter, bases, tmp_path):
    args = _args(bases["llama"])
    _refused(tmp_path / "nowhere", args, "No LoRA adapter found at .*: not a directory")
    weights = os.path.join(llama_adapter, "adapter_model.safetensors")
    os.rename(weights, os.path.join(llama_adapter, "adapter_model.bin"))
    _refused(llama_adapter, args, r"adapter_model.bin \(a pickle\) is not supported")
    os.remove(os.path.join(llama_adapter, "adapter_model.bin"))
    _refused(llama_adapter, args, "has no adapter_model.safetensors")
    os.remove(os.path.join(llama_adapter, "adapter_config.json"))
    _refused(llama_adapter, args, "has no adapter_config.json")


def test_lora_request():
    request = LoRARequest("sql", 3, "/adapters/sql")
    assert (request.adapter_id, request.name, request.path) == (3, "sql", "/adapters/sql")
    assert request.base_model_name is None
    for bad_id in (0, -1, True, 1.0):
        with pytest.raises(ValueError, match="id must be > 0"):
            LoRARequest("sql", bad_id, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/adapters/sql")


@pytest.fixture
def cache_setup(adapters, bases):
    """(args, three adapter paths of the Llama base)."""
    names = ("llama-r8-all", "llama-r4-qv", "llama-r2-regex-layer1-mlp")
    return _args(bases["llama"]), [adapters[n] for n in names]


def test_host_cache_lru_order_and_eviction(cache_setup):
    args, paths = cache_setup
    cache = HostLoRACache(args, max_lora_rank=8, capacity=2)
    requests = {i: LoRARequest(f"a{i}", i, paths[i - 1]) for i in (1, 2, 3)}
    first = cache.get(requests[1])
    assert cache.load_seconds > 0 and first.name == "a1"
    cache.add(requests[2])
    assert cache.ids() == [1, 2]
    assert cache.get(requests[1]) is first  # a hit: no reload
    assert cache.ids() == [2, 1]
    cache.get(requests[3])  # evicts 2, the least recently used
    assert cache.ids() == [1, 3] and 2 not in cache and 1 in cache and 3 in cache
    cache.get(requests[2])  # reloaded; evicts 1
    assert cache.ids() == [3, 2]
    reloaded = cache.get(requests[1])
    assert reloaded is not first and cache.ids() == [2, 1]
    assert cache.remove(2) and cache.ids() == [1] and not cache.remove(2)
    with pytest.raises(ValueError, match="max_cpu_loras must be at least 1, got 0"):
        HostLoRACache(args, max_lora_rank=8, capacity=0)


def test_host_cache_failed_load_caches_nothing(cache_setup, tmp_path):
    args, paths = cache_setup
    cache = HostLoRACache(args, max_lora_rank=4, capacity=2)
    cache.get(LoRARequest("small", 1, paths[1]))
    for request in (LoRARequest("missing", 2, str(tmp_path / "missing")),
                    LoRARequest("too-big", 2, paths[0])):  # rank 8 > max_lora_rank 4
        with pytest.raises(ValueError):
            cache.get(request)
        assert cache.ids() == [1] and 2 not in cache
    assert cache.get(LoRARequest("fine", 2, paths[2])).name == "fine"  # id 2 was never bound
    assert cache.ids() == [1, 2]


def test_host_cache_refuses_one_id_for_two_adapters(cache_setup):
    args, paths = cache_setup
    cache = HostLoRACache(args, max_lora_rank=8, capacity=1)
    cache.get(LoRARequest("a", 1, paths[0]))
    cache.get(LoRARequest("a", 1, paths[0] + "/"))  # the same directory
    for conflict in (LoRARequest("b", 1, paths[0]), LoRARequest("a", 1, paths[1])):
        with pytest.raises(ValueError, match="LoRA id 1 is already used by adapter 'a'"):
            cache.get(conflict)
    cache.get(LoRARequest("b", 2, paths[1]))  # evicts id 1, which stays bound to 'a'
    assert cache.ids() == [2]
    with pytest.raises(ValueError, match="LoRA id 1 is already used"):
        cache.get(LoRARequest("c", 1, paths[2]))
    assert cache.remove(1) and cache.ids() == [2]  # forgets the binding
    assert cache.get(LoRARequest("c", 1, paths[2])).name == "c"
    assert cache.ids() == [1]
