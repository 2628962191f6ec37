"""Pipeline parallelism: greedy outputs on 8 simulated CPU devices equal one device's, token for
token, for PP=2, PP=4, PP=2 x TP=2, PP=2 x DP=2 and an uneven split (tiny Llama and tiny MoE),
with chunked prefill and preemption; no compilation after warm-up at PP=2; the layer split and
the errors for sizes that do not fit.

The multi-device runs need XLA_FLAGS before jax starts, so they run in one child process (this
file run as a script), as tests/test_sharding.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import TINY_CONFIGS, CompileCounter, cpu_devices_env, save_random_checkpoint
from test_sharding import TINY_MOE

NUM_DEVICES = 8
MAX_TOKENS = 8
LLAMA4 = dict(TINY_CONFIGS["llama"], num_hidden_layers=4)
MOE4 = dict(TINY_MOE, num_hidden_layers=4)
PP2 = dict(pipeline_parallel_size=2)
# (name, engine kwargs, VLLM_PP_LAYER_PARTITION) per model; the first is the one-device reference
LLAMA_RUNS = [("pp1", {}, None), ("pp2", PP2, None),
              ("pp4", dict(pipeline_parallel_size=4), None),
              ("pp2xtp2", dict(PP2, tensor_parallel_size=2), None),
              ("pp2xdp2", dict(PP2, data_parallel_size=2), None),
              ("pp2_uneven_3_1", PP2, "3,1"),
              ("pp2_sync", dict(PP2, async_scheduling=False), None)]
MOE_RUNS = [("pp1", {}, None), ("pp2", PP2, None),
            ("pp4", dict(pipeline_parallel_size=4), None),
            ("pp2xtp2", dict(PP2, tensor_parallel_size=2), None),
            # DP attention: one engine, each stage's step over both DP ranks, experts over both
            ("pp2xdp2_ep", dict(PP2, data_parallel_size=2, enable_expert_parallel=True), None),
            ("pp2_uneven_1_3", PP2, "1,3")]
# Chunked prefill (an 8-token budget, prompts up to 33 tokens) and preemption (11 usable blocks
# of 8 tokens for 4 running requests of up to 41 tokens).
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              num_gpu_blocks_override=12, block_size=8, enforce_eager=True,
              compilation_cache_dir=None)
PROMPT_LENGTHS = [5, 19, 2, 33, 27]


def _generate_all(model_dir: str, runs, vocab: int) -> dict:
    from jaxllm import LLM, SamplingParams

    prompts = [np.random.default_rng(i).integers(3, vocab, size=n).tolist()
               for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results = {}
    for name, kwargs, partition in runs:
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        if partition is not None:
            os.environ["VLLM_PP_LAYER_PARTITION"] = partition
        llm = LLM(model_dir, **ENGINE, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        results[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                         "preemptions": stats["num_preemptions_total"],
                         "blocks_free": stats["num_free_blocks"] == stats["num_blocks"]
                         - llm.llm_engine.config.parallel_config.data_parallel_size}
    os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    return results


def _compilations_after_warmup(model_dir: str) -> dict:
    """PP=2 with warm-up, then every sampler feature: how many programs compile while serving."""
    import jax

    from jaxllm import LLM, SamplingParams

    llm = LLM(model_dir, **dict(ENGINE, enforce_eager=False, max_num_batched_tokens=16,
                                num_gpu_blocks_override=48), **PP2)
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        rng = np.random.default_rng(5)
        prompts = [{"prompt_token_ids": rng.integers(3, 384, size=n).tolist()}
                   for n in (3, 30, 12, 7)]
        params = [SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
                  SamplingParams(temperature=0.8, top_p=0.9, top_k=5, seed=1, max_tokens=9,
                                 prompt_logprobs=1),
                  SamplingParams(temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5,
                                 max_tokens=5, n=2),
                  SamplingParams(temperature=0.0, frequency_penalty=0.3, max_tokens=4)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)  # prefix cache hits: record_history
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    return {"compilations": counter.count}


def _child_main(llama_dir: str, moe_dir: str) -> None:
    import jax

    assert len(jax.devices()) == NUM_DEVICES, jax.devices()
    print(json.dumps({"llama": _generate_all(llama_dir, LLAMA_RUNS, 384),
                      "moe": _generate_all(moe_dir, MOE_RUNS, 96),
                      "warmup": _compilations_after_warmup(llama_dir)}))


def test_pipeline_parallel_equals_one_device_on_8_devices(tmp_path):
    llama_dir = save_random_checkpoint(LLAMA4, str(tmp_path / "llama"), seed=3)
    moe_dir = save_random_checkpoint(MOE4, str(tmp_path / "moe"), seed=7)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The child imports this checkout's jaxllm (a script's path puts tests/ first, not the root).
    env = dict(cpu_devices_env(NUM_DEVICES), PYTHONPATH=root)
    env.pop("VLLM_PP_LAYER_PARTITION", None)
    proc = subprocess.run([sys.executable, __file__, llama_dir, moe_dir], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results.pop("warmup") == {"compilations": 0}
    for model, runs in results.items():
        reference = runs["pp1"]["tokens"]
        assert all(len(tokens) == MAX_TOKENS for tokens in reference)
        assert runs["pp1"]["preemptions"] > 0  # the pool is small enough to preempt
        for name, run in runs.items():
            assert run["tokens"] == reference, f"{model} {name}: {run['tokens']} != {reference}"
            assert run["blocks_free"], f"{model} {name} leaked KV blocks"
        assert runs["pp2"]["preemptions"] > 0 and runs["pp2xtp2"]["preemptions"] > 0


@pytest.mark.parametrize("num_layers, pp, sizes", [
    (4, 2, [2, 2]), (5, 2, [3, 2]), (6, 4, [1, 2, 2, 1]), (7, 4, [2, 2, 2, 1]),
    (20, 4, [5, 5, 5, 5]), (4, 4, [1, 1, 1, 1])])
def test_layer_partition_is_vllms(num_layers, pp, sizes, monkeypatch):
    from jaxllm.sharding.pipeline import layer_partition

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    bounds = layer_partition(num_layers, pp)
    assert [end - start for start, end in bounds] == sizes
    assert bounds[0][0] == 0 and bounds[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_layer_partition_from_env(monkeypatch):
    from jaxllm.sharding.pipeline import layer_partition

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "4,6,6,4")
    assert layer_partition(20, 4) == [(0, 4), (4, 10), (10, 16), (16, 20)]


@pytest.mark.parametrize("partition, message", [
    ("3,2", r"sums to 5 layers, but the model has 4"),
    ("1,1,2", r"has 3 stages, but pipeline_parallel_size is 2"),
    ("4,0", r"every stage needs at least one layer"),
    ("2;2", r"Invalid partition string")])
def test_bad_partition_is_refused_before_loading(partition, message, monkeypatch):
    from jaxllm.sharding.pipeline import layer_partition

    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    with pytest.raises(ValueError, match=message):
        layer_partition(4, 2)


def test_sizes_that_do_not_fit_are_refused(tiny_llama_dir, monkeypatch):
    from jaxllm import LLM
    from jaxllm.engine.args import EngineArgs

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    # tiny_llama_dir has 2 layers
    with pytest.raises(ValueError, match=r"hidden layers \(2\) must be at least "
                                         r"pipeline_parallel_size \(4\)"):
        EngineArgs(tiny_llama_dir, pipeline_parallel_size=4).create_engine_config()
    with pytest.raises(ValueError, match=r"World size \(4 = tensor_parallel_size 2 x "
                                         r"data_parallel_size 1 x pipeline_parallel_size 2\) is "
                                         r"larger than the number of available devices \(1\)"):
        LLM(tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2, enforce_eager=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1|at least 1"):
        EngineArgs(tiny_llama_dir, pipeline_parallel_size=0).create_engine_config()
    with pytest.raises(ValueError, match=r"does not support speculative decoding yet"):
        EngineArgs(tiny_llama_dir, pipeline_parallel_size=2, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2}).create_engine_config()


if __name__ == "__main__":
    _child_main(*sys.argv[1:3])
