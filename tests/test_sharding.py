"""Sharding: mesh errors, partition rules, and greedy outputs on 8 simulated CPU devices.

The multi-device runs need XLA_FLAGS before jax starts, so they run in a child process (this file
run as a script); the rest of the suite keeps its single device. All configs share that one child
(~45 s CPU): 3 short prompts, one token bucket (max_num_batched_tokens=16), no warm-up, no
persistent compilation cache, so each config compiles its step once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import cpu_devices_env, save_random_checkpoint

NUM_DEVICES = 8
MAX_TOKENS = 5
# Heads 8, KV heads 2: TP=4 and TP=8 replicate KV heads; 8 experts split whole with EP=8.
TINY_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=96,
                hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                head_dim=16, intermediate_size=40, moe_intermediate_size=24, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False)
# (name, engine kwargs) per model; the first of each is the single-device reference
LLAMA_RUNS = [("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
              ("tp4", dict(tensor_parallel_size=4)), ("dp2", dict(data_parallel_size=2)),
              ("tp2xdp2", dict(tensor_parallel_size=2, data_parallel_size=2)),
              ("tp2_ngram", dict(tensor_parallel_size=2, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 2}))]
MOE_RUNS = [("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
            ("ep4", dict(tensor_parallel_size=4, enable_expert_parallel=True)),
            ("ep8", dict(tensor_parallel_size=8, enable_expert_parallel=True))]
# FP8 weights, experts included (Fp8Experts: the [E, N] scale split with the experts' N or E)
MOE_FP8_RUNS = [(name, dict(kwargs, quantization="fp8")) for name, kwargs in MOE_RUNS[:3]]


def _save_tiny_moe(out_dir: str) -> str:
    return save_random_checkpoint(TINY_MOE, out_dir, seed=7)


def _generate_all(model_dir: str, runs, vocab: int) -> dict[str, list[list[int]]]:
    from jaxllm import LLM, SamplingParams

    prompts = [np.random.default_rng(i).integers(3, vocab, size=n).tolist()
               for i, n in enumerate([5, 19, 2])]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for name, kwargs in runs:
        llm = LLM(model_dir, dtype="float32", max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=16, num_gpu_blocks_override=48, block_size=8,
                  enforce_eager=True, compilation_cache_dir=None, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[name] = [list(o.outputs[0].token_ids) for o in outs]
    return results


def _child_main(llama_dir: str, moe_dir: str, llama_ckpt: str) -> None:
    import jax

    assert len(jax.devices()) == NUM_DEVICES, jax.devices()
    llama = _generate_all(llama_dir, LLAMA_RUNS, 384)
    # The Orbax checkpoint restored straight into the TP=4 shardings (KV heads expanded after).
    llama |= _generate_all(llama_ckpt, [("tp4_orbax", dict(tensor_parallel_size=4))], 384)
    print(json.dumps({"llama": llama, "moe": _generate_all(moe_dir, MOE_RUNS, 96),
                      "moe_fp8": _generate_all(moe_dir, MOE_FP8_RUNS, 96),
                      "serve_engine": _serve_engine_kind(llama_ckpt),
                      "tp2_step": _tp2_step_collectives(llama_dir)}))


def _tp2_step_collectives(model_dir: str) -> dict:
    """Per sampler-stage program of the tiny Llama's TP=2 step (one KV head per device): its
    collectives by kind, and how many instructions copy a whole KV cache."""
    import re

    from jaxllm import LLM
    from jaxllm.worker.packing import pack

    llm = LLM(model_dir, dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=48, block_size=8,
              enforce_eager=True, compilation_cache_dir=None, tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    cache = runner.kv_caches[0][0]
    local = ",".join(map(str, cache.sharding.shard_shape(cache.shape)))
    cache_copy = re.compile(rf"%\S*copy\S* = f32\[{local}\]|= f32\[{local}\]\S* copy\(")
    collective = re.compile(r"= .+? (all-reduce|all-gather|all-to-all|collective-permute|"
                            r"reduce-scatter)(-start)?\(")
    packed, layout = pack(runner._padding_inputs(16))
    programs = {}
    for stages in ("cond", "greedy", "plain", "all"):
        text = runner._lower(packed, layout, stages).compile().as_text()
        kinds = [m.group(1) for m in map(collective.search, text.splitlines()) if m]
        programs[stages] = {"collectives": {k: kinds.count(k) for k in sorted(set(kinds))},
                            "cache_copies": len(cache_copy.findall(text))}
    return programs


def _serve_engine_kind(model: str) -> str:
    """`jaxllm serve OUT --data-parallel-size 2` builds its engine (no steps: nothing compiles)."""
    import argparse

    from jaxllm.server.cli import add_serve_args, build_serving

    args = add_serve_args(argparse.ArgumentParser()).parse_args(
        [model, "--data-parallel-size", "2", "--dtype", "float32", "--max-model-len", "64",
         "--num-gpu-blocks-override", "16", "--block-size", "8", "--enforce-eager"])
    serving = build_serving(args)
    try:
        return type(serving.engine.core).__name__
    finally:
        serving.engine.shutdown()


def test_greedy_outputs_equal_single_device_on_8_devices(tiny_llama_dir, tmp_path):
    from jaxllm.loader.convert import convert

    moe_dir = _save_tiny_moe(str(tmp_path / "moe"))
    llama_ckpt = convert(tiny_llama_dir, str(tmp_path / "llama_ckpt"), dtype="float32")
    env = cpu_devices_env(NUM_DEVICES)
    proc = subprocess.run([sys.executable, __file__, tiny_llama_dir, moe_dir, llama_ckpt], env=env,
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results.pop("serve_engine") == "DPEngine"
    # The TP=2 step of a 2-layer model: the embedding's all-reduce, two per layer, one
    # all-gather of the logits (and one of each prompt-logprobs chunk's, under "cond"); the
    # sampler runs on replicated logits, and no KV cache is copied.
    model_only = {"all-reduce": 5, "all-gather": 1}
    assert results.pop("tp2_step") == {
        "cond": {"collectives": dict(model_only, **{"all-gather": 2}), "cache_copies": 0},
        "greedy": {"collectives": model_only, "cache_copies": 0},
        "plain": {"collectives": model_only, "cache_copies": 0},
        "all": {"collectives": model_only, "cache_copies": 0}}
    for model, runs in results.items():
        reference = runs["tp1"]
        assert all(len(tokens) == MAX_TOKENS for tokens in reference)
        assert len(runs) == {"llama": len(LLAMA_RUNS) + 1, "moe": len(MOE_RUNS),
                             "moe_fp8": len(MOE_FP8_RUNS)}[model]
        for name, outputs in runs.items():
            assert outputs == reference, f"{model} {name}: {outputs} != {reference}"


def _multihost_child_main(process_id: str, port: str, model_dir: str) -> None:
    """One of two processes (2 CPU devices each): jax.distributed over loopback, then the engine
    with TP=4, so every layer's all-reduce crosses the process boundary (gloo)."""
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=int(process_id), initialization_timeout=60)
    assert (jax.process_count(), len(jax.devices()), len(jax.local_devices())) == (2, 4, 2)
    runs = _generate_all(model_dir, [("tp4_2proc", dict(tensor_parallel_size=4))], 384)
    print(json.dumps(runs["tp4_2proc"]), flush=True)
    jax.distributed.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_loopback_equal_single_device(tiny_llama_dir):
    env = cpu_devices_env(2)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, __file__, "multihost", str(i), port, tiny_llama_dir],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
             for i in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]  # bounded: never hangs the suite
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results):
        if p.returncode and "collective" in err.lower() and "not" in err.lower():
            pytest.skip(f"jax's CPU backend cannot run cross-process collectives here: "
                        f"{err.strip().splitlines()[-1]}")
        assert p.returncode == 0, err[-4000:]
    reference = _generate_all(tiny_llama_dir, [("tp1", {})], 384)["tp1"]
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    for out, _ in results:
        assert json.loads(out.strip().splitlines()[-1]) == reference


def test_mesh_errors_name_the_numbers():
    from jaxllm.config import ParallelConfig
    from jaxllm.models import ModelArgs
    from jaxllm.sharding.mesh import make_mesh, validate_model_parallelism

    with pytest.raises(ValueError, match=r"World size \(4 .*available devices \(1\)"):
        make_mesh(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2))
    cfg = dict(TINY_MOE)
    args = ModelArgs.from_hf_config(cfg)
    with pytest.raises(ValueError, match=r"attention heads \(8\).*tensor parallel size \(3\)"):
        validate_model_parallelism(args, ParallelConfig(tensor_parallel_size=3))
    three_kv = ModelArgs.from_hf_config(dict(cfg, num_attention_heads=12, num_key_value_heads=3))
    with pytest.raises(ValueError, match=r"key-value heads \(3\).*tensor parallel size \(4\)"):
        validate_model_parallelism(three_kv, ParallelConfig(tensor_parallel_size=4))
    odd_experts = ModelArgs.from_hf_config(dict(cfg, num_experts=6, moe_intermediate_size=32))
    with pytest.raises(ValueError, match=r"experts \(6\).*expert parallel size \(4\)"):
        validate_model_parallelism(odd_experts, ParallelConfig(4, 1, True))
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(24\).*\(16\)"):
        validate_model_parallelism(ModelArgs.from_hf_config(dict(cfg, num_attention_heads=16,
                                                                 num_key_value_heads=16,
                                                                 mlp_only_layers=[])),
                                   ParallelConfig(tensor_parallel_size=16))


def test_ep_with_one_device_warns(caplog):
    from jaxllm.config import ParallelConfig
    from jaxllm.sharding.mesh import make_mesh

    with caplog.at_level("WARNING"):
        mesh = make_mesh(ParallelConfig(enable_expert_parallel=True))
    assert dict(mesh.shape) == {"data": 1, "pipe": 1, "tensor": 1}
    assert "expert parallelism has no effect" in caplog.text


def test_rules_cover_every_param_and_expand_kv_heads():
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxllm.config import ParallelConfig
    from jaxllm.loader.hf_names import flatten_paths
    from jaxllm.models import ModelArgs, param_shapes
    from jaxllm.sharding.mesh import make_mesh
    from jaxllm.sharding.rules import ShardingPlan, expand_kv_heads

    args = ModelArgs.from_hf_config(dict(TINY_MOE))
    plan = ShardingPlan(make_mesh(ParallelConfig()), args, expert_parallel=True)
    specs = {path: plan.spec(path, len(shape))
             for path, shape in flatten_paths(param_shapes(args)).items()}
    assert specs["embed"] == P("tensor", None) and specs["lm_head"] == P(None, "tensor")
    assert specs["layers.0.wq"] == P(None, "tensor") and specs["layers.0.wo"] == P("tensor", None)
    assert specs["layers.0.w_down"] == P("tensor", None)
    assert specs["layers.1.experts_gate"] == P(("data", "tensor"), None, None)
    assert specs["layers.1.router"] == P() and specs["layers.1.q_norm"] == P()
    for path, shape in flatten_paths(param_shapes(args)).items():  # loader's guess == real ndim
        assert plan.spec(path) == specs[path], path
    w = jnp.asarray(np.random.default_rng(0).normal(size=(3, 2 * 4)), jnp.float32)  # 2 heads of 4
    expanded = np.asarray(expand_kv_heads(w, 2, 4)).reshape(3, 4, 4)
    np.testing.assert_array_equal(expanded[:, 1], np.asarray(w)[:, :4])
    np.testing.assert_array_equal(expanded[:, 2], np.asarray(w)[:, 4:])
    assert jax.devices()  # single device in the main process


def test_orbax_convert_then_restore_roundtrip(tiny_llama_dir, tmp_path):
    import jax

    from jaxllm.loader import load_model
    from jaxllm.loader.convert import convert
    from jaxllm.loader.orbax_ckpt import is_orbax_checkpoint, restore_params

    out = convert(tiny_llama_dir, str(tmp_path / "ckpt"), dtype="float32")
    assert is_orbax_checkpoint(out) and not is_orbax_checkpoint(tiny_llama_dir)
    loaded = load_model(tiny_llama_dir, dtype="float32")
    restored = restore_params(out, loaded.args)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded.params, restored)
    as_bf16 = restore_params(out, loaded.args, dtype="bfloat16")
    assert {a.dtype.name for a in jax.tree.leaves(as_bf16)} == {"bfloat16"}


def test_jaxllm_convert_then_llm_loads_the_checkpoint(tiny_llama_dir, tmp_path, capsys):
    from jaxllm import LLM, SamplingParams
    from jaxllm.cli import main
    from jaxllm.loader.orbax_ckpt import is_orbax_checkpoint

    out = str(tmp_path / "ckpt")
    main(["convert", tiny_llama_dir, out, "--dtype", "float32"])
    assert capsys.readouterr().out.strip() == out and is_orbax_checkpoint(out)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    texts = {}
    for model in (tiny_llama_dir, out):
        llm = LLM(model, dtype="float32", max_model_len=64, num_gpu_blocks_override=16,
                  block_size=8, max_num_seqs=2, max_num_batched_tokens=16, enforce_eager=True,
                  compilation_cache_dir=None)
        outs = llm.generate(["The quick brown fox", "Hello world"], params, use_tqdm=False)
        texts[model] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]
        assert llm.llm_engine.eos_token_ids == {2}  # generation config carried over
    assert texts[out] == texts[tiny_llama_dir]


if __name__ == "__main__":
    if sys.argv[1] == "multihost":
        _multihost_child_main(*sys.argv[2:5])
    else:
        _child_main(*sys.argv[1:4])
