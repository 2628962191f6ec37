"""DP attention (vLLM's rule for MoE with DP > 1 and expert parallelism): one engine over the
[DP, TP] mesh, attention and KV pools per DP rank, experts split over all DP x TP devices.

All checks share one child process with 8 simulated CPU devices (as test_sharding.py): a tiny
Qwen3-MoE (8 experts) generates with DP=2 x TP=1 (EP 2, async scheduling on and off), DP=2 x TP=2
(EP 4, warmed up: nothing may compile afterwards) and DP=4 x TP=2 (EP 8), and every output must
equal the single-device engine's token for token. Prompts of different lengths (one chunked) and
max_tokens leave ranks idle while others work; greedy, seeded-random and penalised requests share
the batch, so a request read from another rank's rows would show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import cpu_devices_env

from test_sharding import TINY_MOE, _save_tiny_moe

NUM_DEVICES = 8
PROMPT_LENS = [5, 40, 2, 11, 7]  # 40 > the 32-token budget: a chunked prefill
MAX_TOKENS = [6, 3, 8, 4, 5]
# (name, engine kwargs); the warmed-up run also counts compilations
RUNS = [("dp2", dict(data_parallel_size=2)),
        ("dp2_sync", dict(data_parallel_size=2, async_scheduling=False)),
        ("dp2xtp2", dict(data_parallel_size=2, tensor_parallel_size=2, enforce_eager=False)),
        ("dp4xtp2", dict(data_parallel_size=4, tensor_parallel_size=2))]
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=24, block_size=8, compilation_cache_dir=None,
              enforce_eager=True)


def _requests():
    from jaxllm import SamplingParams

    prompts = [np.random.default_rng(i).integers(3, TINY_MOE["vocab_size"], size=n).tolist()
               for i, n in enumerate(PROMPT_LENS)]
    kinds = [dict(temperature=0.0), dict(temperature=0.0), dict(temperature=1.0, seed=11),
             dict(temperature=0.0, repetition_penalty=1.5),
             dict(temperature=0.8, top_k=20, seed=5)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **k)
              for m, k in zip(MAX_TOKENS, kinds)]
    return [{"prompt_token_ids": p} for p in prompts], params


def _record_rank_loads(engine) -> list[list[int]]:
    """Requests per rank in every launched step."""
    loads, launch = [], engine.runner.launch

    def recording_launch(scheduler_output):
        loads.append([out.num_reqs for out in scheduler_output.ranks])
        return launch(scheduler_output)

    engine.runner.launch = recording_launch
    return loads


def _placement(engine) -> dict:
    """Per-device shards of an MoE layer's experts (layer 0 is dense) and of the KV cache."""
    layer = engine.runner.params["layers"][1]
    experts = {name: dict(shard_shape=list(w.sharding.shard_shape(w.shape)),
                          num_devices=len(w.sharding.device_set),
                          first_experts=sorted({s.index[0].start or 0
                                                for s in w.addressable_shards}))
               for name, w in layer.items() if name.startswith("experts_")}
    k_cache = engine.runner.kv_caches[0][0]
    return dict(experts=experts, kv_shape=list(k_cache.shape),
                kv_shard_shape=list(k_cache.sharding.shard_shape(k_cache.shape)),
                kv_first_blocks=sorted({s.index[0].start or 0
                                        for s in k_cache.addressable_shards}),
                num_blocks=engine.num_blocks, dp_size=engine.dp_size)


def _abort_frees_rank_blocks(engine) -> dict:
    """Two requests land on different ranks; aborting one returns exactly its rank's blocks."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", list(range(3, 30)), params)
    engine.add_request("b", list(range(3, 12)), params)
    ranks = [engine.scheduler.rank_of(engine.output_processor.child_ids(r)[0]) for r in "ab"]
    for _ in range(3):
        engine.step()
    free = lambda: [s.kv_cache_manager.num_free_blocks for s in engine.scheduler_ranks]  # noqa
    before = free()
    engine.abort_request(["a"])
    after = free()
    while engine.has_unfinished_requests():
        engine.step()
    return dict(ranks=ranks, before=before, after=after, drained=free(),
                num_blocks=engine.num_blocks)


def _child_main(moe_dir: str) -> None:
    import jax

    from jaxllm import LLM
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.builder import make_engine
    from conftest import CompileCounter

    assert len(jax.devices()) == NUM_DEVICES, jax.devices()
    prompts, params = _requests()

    def generate(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    facts = {"reference": generate(LLM(moe_dir, **ENGINE))}
    for name, kwargs in RUNS:
        llm = LLM(moe_dir, **{**ENGINE, **kwargs, "enable_expert_parallel": True})
        engine = llm.llm_engine
        loads, counter = _record_rank_loads(engine), CompileCounter()
        jax.monitoring.register_event_duration_secs_listener(counter)
        try:
            outputs = generate(llm)
        finally:
            jax.monitoring.unregister_event_duration_listener(counter)
        facts[name] = dict(outputs=outputs, engine=type(engine).__name__, loads=loads,
                           compilations=counter.count, placement=_placement(engine),
                           free_blocks=engine.get_stats()["num_free_blocks"])
        if name == "dp2":
            facts["abort"] = _abort_frees_rank_blocks(engine)
    without_ep = make_engine(EngineArgs(moe_dir, data_parallel_size=2, **ENGINE))
    facts["engine_without_ep"] = type(without_ep).__name__
    print(json.dumps(facts))


def _check_placement(placement: dict, dp: int, tp: int) -> None:
    ep, cfg = dp * tp, TINY_MOE
    hidden, inter, experts = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    local = experts // ep
    expected = {"experts_gate": [local, hidden, inter], "experts_up": [local, hidden, inter],
                "experts_down": [local, inter, hidden]}
    for name, shape in expected.items():
        got = placement["experts"][name]
        assert got == dict(shard_shape=shape, num_devices=ep,
                           first_experts=list(range(0, experts, local))), (name, got)
    num_blocks, kv_heads = placement["num_blocks"], cfg["num_key_value_heads"]
    head_dim, block_size = cfg["head_dim"], ENGINE["block_size"]
    assert placement["dp_size"] == dp
    assert placement["kv_shape"] == [dp * num_blocks, kv_heads, block_size, head_dim]
    assert placement["kv_shard_shape"] == [num_blocks, kv_heads // tp, block_size, head_dim]
    assert placement["kv_first_blocks"] == list(range(0, dp * num_blocks, num_blocks))


def test_dp_attention_equals_single_device_on_8_devices(tmp_path):
    moe_dir = _save_tiny_moe(str(tmp_path / "moe"))
    env = cpu_devices_env(NUM_DEVICES)
    proc = subprocess.run([sys.executable, __file__, moe_dir], env=env, capture_output=True,
                          text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    reference = facts["reference"]
    assert [len(tokens) for tokens in reference] == MAX_TOKENS
    for name, kwargs in RUNS:
        run = facts[name]
        dp, tp = kwargs["data_parallel_size"], kwargs.get("tensor_parallel_size", 1)
        assert run["engine"] == "EngineCore", name
        assert run["outputs"] == reference, f"{name}: {run['outputs']} != {reference}"
        assert all(len(step) == dp for step in run["loads"]), name
        # some step ran a rank on padding alone while another rank had requests
        assert any(0 in step and max(step) > 0 for step in run["loads"]), run["loads"]
        _check_placement(run["placement"], dp, tp)
        assert run["free_blocks"] == dp * (run["placement"]["num_blocks"] - 1), name
    assert facts["dp2xtp2"]["compilations"] == 0, "compiled after warm-up"
    assert facts["dp2"]["compilations"] > 0  # the counter sees an eager engine compile
    abort = facts["abort"]
    usable = abort["num_blocks"] - 1
    rank_a, rank_b = abort["ranks"]
    assert rank_a != rank_b
    assert abort["before"][rank_a] < usable and abort["before"][rank_b] < usable, abort
    assert abort["after"][rank_a] == usable, abort
    assert abort["after"][rank_b] == abort["before"][rank_b], abort
    assert abort["drained"] == [usable, usable], abort
    assert facts["engine_without_ep"] == "DPEngine"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _child_main(sys.argv[1])
