"""benchmarks/engine_timeline.py: its per-step stages account for an offline run's wall time,
and it leaves the engine as it found it."""

import json
import os
import sys

from jaxllm import LLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import engine_timeline  # noqa: E402


def test_stages_account_for_the_run(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              num_gpu_blocks_override=64, block_size=8, enforce_eager=True,
              compilation_cache_dir=None)
    result = engine_timeline.run(llm, 6, 20, 8, "cprofile", 1, str(tmp_path))
    # 6 prompts of 20 tokens, 4 at a time, 32 tokens a step: prefill steps, then decode steps
    assert result["steps"] > result["decode_steps"] > 0
    stages = result["total_s"]
    assert abs(result["host_s"] + stages["wait"] - sum(stages.values())) < 1e-6
    # the stages cover the run but the loop's glue and input processing
    assert 0.5 * result["wall_s"] < sum(stages.values()) <= result["wall_s"]
    assert result["output_tok_per_s"] > 0
    assert os.path.getsize(tmp_path / "host_stages.pstats") > 0
    with open(tmp_path / "steps_cprofile_1.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) >= result["steps"] >= result["host_bound_steps"] >= 0
    assert sum(row["tokens"] for row in rows) >= 6 * 20 + 6 * 7  # prompts, then decodes
    host_bound = [r for r in rows if r["seqs"] and r["wait"] < engine_timeline.HOST_BOUND_WAIT_S]
    assert result["host_bound_steps"] == len(host_bound)
    engine = llm.llm_engine
    for obj in (engine.runner, engine.scheduler, engine.output_processor):
        assert not {"schedule", "launch", "collect", "update_from_output", "process"} & set(
            vars(obj))
