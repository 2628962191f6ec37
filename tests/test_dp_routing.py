"""The DP router with prefix caching: a request goes to the replica that holds its prompt's
prefix unless that replica is busier than the least loaded by more than the bound
(max(4, max_num_seqs // 4) = 4 here), and outputs equal one engine's without caching.

DP=2 needs two devices, so the engine runs in a child process with 2 simulated CPU devices
(as test_sharding.py); eager, no warm-up, one small bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from conftest import cpu_devices_env

BLOCK_SIZE = 8
PREFIX_LEN = 24  # three full blocks
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=48, block_size=BLOCK_SIZE, enforce_eager=True,
              compilation_cache_dir=None)
# After "first" has finished on rank 0: "filler" (no prefix anywhere) ties and takes rank 0, so
# the least loaded replica is rank 1 from then on; the shared-prefix requests still go to rank 0
# while its load is within 4 of rank 1's, so rank 0 takes four, then rank 1 one (rank 0 at 5
# against 0), then rank 0 again (5 against 1).
EXPECTED_RANKS = {"filler": 0, "shared0": 0, "shared1": 0, "shared2": 0, "shared3": 0,
                  "shared4": 1, "shared5": 0}


def _prompts(vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, vocab, size=PREFIX_LEN).tolist()
    prompts = {"first": prefix + rng.integers(3, vocab, size=4).tolist(),
               "filler": rng.integers(3, vocab, size=PREFIX_LEN + 4).tolist()}
    for i in range(6):
        prompts[f"shared{i}"] = prefix + rng.integers(3, vocab, size=4 + i).tolist()
    return prompts


def _drain(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (list(out.outputs[0].token_ids), out.num_cached_tokens)
    return outputs


def _child_main(model_dir: str) -> None:
    import jax

    from jaxllm import LLM, SamplingParams

    assert len(jax.devices()) == 2, jax.devices()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    dp = LLM(model_dir, data_parallel_size=2, **ENGINE).llm_engine
    prompts = _prompts(300)  # ids the tiny tokenizer knows (LLM.generate checks them)
    dp.add_request("first", prompts["first"], params)
    ranks = {"first": dp._replica_of["first"]}
    outputs = _drain(dp)
    for request_id, tokens in prompts.items():
        if request_id != "first":
            dp.add_request(request_id, tokens, params)
            ranks[request_id] = dp._replica_of[request_id]
    loads = list(dp._loads)
    outputs |= _drain(dp)
    hits = [replica.get_stats()["prefix_cache_hits_total"] for replica in dp.replicas]
    reference = LLM(model_dir, enable_prefix_caching=False, **ENGINE)
    expected = reference.generate([{"prompt_token_ids": p} for p in prompts.values()], params,
                                  use_tqdm=False)
    # each replica sizes its KV cache on its own device (rank 0's cache fills device 0 first)
    from jaxllm.worker import kv_cache
    measured_on = []
    kv_cache.device_memory_limit = lambda: 1
    kv_cache.device_memory_available = (
        lambda utilization, activations, device=None: measured_on.append(str(device)) or 10**6)
    LLM(model_dir, data_parallel_size=2, **{**ENGINE, "num_gpu_blocks_override": None})
    print(json.dumps({"ranks": ranks, "loads": loads, "outputs": outputs, "hits": hits,
                      "measured_on": measured_on, "devices": [str(d) for d in jax.devices()],
                      "loads_after": list(dp._loads),
                      "reference": {rid: list(out.outputs[0].token_ids)
                                    for rid, out in zip(prompts, expected)}}))


def test_shared_prefix_goes_to_the_replica_that_holds_it_within_the_load_bound(tiny_llama_dir):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # PYTHONPATH: this checkout's jaxllm, not an installed one (a script's sys.path starts at
    # its own folder, not the cwd)
    env = dict(cpu_devices_env(2), PYTHONPATH=root)
    proc = subprocess.run([sys.executable, __file__, tiny_llama_dir], env=env, capture_output=True,
                          text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts["measured_on"] == facts["devices"]
    assert facts["ranks"] == {"first": 0, **EXPECTED_RANKS}
    assert facts["loads"] == [6, 1] and facts["loads_after"] == [0, 0]
    outputs = facts["outputs"]
    cached = {rid: num_cached for rid, (_, num_cached) in outputs.items()}
    # rank 0 held the prefix for every shared request routed there; rank 1 held nothing
    assert cached == {"first": 0, "filler": 0, "shared4": 0,
                      **{f"shared{i}": PREFIX_LEN for i in (0, 1, 2, 3, 5)}}
    assert facts["hits"] == [5 * PREFIX_LEN, 0]
    assert {rid: tokens for rid, (tokens, _) in outputs.items()} == facts["reference"]
    assert all(len(tokens) == 4 for tokens in facts["reference"].values())


if __name__ == "__main__":
    _child_main(sys.argv[1])
