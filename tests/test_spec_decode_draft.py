"""Speculative decoding with a draft model (method draft_model, drafting on device after each
step, its KV under the target's block tables): the config and its refusals, greedy and seeded
output identical to the same engine without speculation (also under preemption and chunked
prefill), the target as its own draft accepting every draft (the drafts sit at the right
positions), no KV block left after aborts, and no compilation after warm-up."""

from __future__ import annotations

import json
import random

import jax
import pytest

from conftest import CompileCounter
from jaxllm import SamplingParams
from jaxllm.config import SpeculativeConfig
from jaxllm.engine.args import EngineArgs
from test_spec_decode import (GREEDY, assert_same_outputs, drafts_checked_after_every_step,
                              make_llm, mixed_params, repetitive_prompts, token_ids)

K = 3


def draft_spec(draft_dir: str, k: int = K) -> dict:
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, tiny_llama_dir) -> str:
    """The target without its last layer: a weaker model of the same vocabulary, whose greedy
    tokens agree with the target's often but not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path_factory.mktemp("tiny_draft"))
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, num_hidden_layers=1).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(out)
    return out


def spec_llm(target_dir: str, draft_dir: str, k: int = K, **kwargs):
    return make_llm(target_dir, False, speculative_config=draft_spec(draft_dir, k), **kwargs)


def assert_no_blocks_held(llm) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_blocks"] == engine.num_blocks - 1


def spec_stats(llm, before: dict) -> dict:
    return {key: value - before[key] for key, value in llm.llm_engine.get_stats().items()
            if key.startswith("spec_decode") and key.endswith("_total")}


# -- config --------------------------------------------------------------------------------------
def test_config_builds_the_draft_model_config(tiny_llama_dir, tiny_draft_dir):
    config = EngineArgs(model=tiny_llama_dir, max_model_len=96, dtype="float32",
                        speculative_config=json.dumps(draft_spec(tiny_draft_dir))
                        ).create_engine_config()
    draft = config.speculative_config.draft_model_config
    assert (draft.model, draft.max_model_len, draft.dtype) == (tiny_draft_dir, 96, "float32")
    assert draft.hf_config["num_hidden_layers"] == 1
    assert config.runner_config.async_scheduling  # synchronous only while speculating


def test_vocab_mismatch_refused(tiny_llama_dir, tmp_path):
    with open(tmp_path / "config.json", "w") as f:  # refused before any weight is read
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "vocab_size": 512, "max_position_embeddings": 512}, f)
    with pytest.raises(ValueError, match=r"same vocabulary size\. Target model "
                                         r"vocab_size=384\. Draft model vocab_size=512"):
        EngineArgs(model=tiny_llama_dir, speculative_config=draft_spec(str(tmp_path))
                   ).create_engine_config()


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2},
                                      {"pipeline_parallel_size": 2}])
def test_parallel_refused(tiny_llama_dir, tiny_draft_dir, parallel):
    with pytest.raises(ValueError, match="method draft_model is not supported with tensor, "
                                         "pipeline or data parallelism"):
        EngineArgs(model=tiny_llama_dir, speculative_config=draft_spec(tiny_draft_dir),
                   **parallel).create_engine_config()


def test_model_required():
    with pytest.raises(ValueError, match="needs 'model' for method draft_model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, False, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def draft_llm(tiny_llama_dir, tiny_draft_dir):
    return spec_llm(tiny_llama_dir, tiny_draft_dir, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(plain_llm):
    prompts = repetitive_prompts(20, 6)
    return prompts, token_ids(plain_llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("kwargs", [None, {"num_gpu_blocks_override": 20},
                                    {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["plain", "preemption", "chunked_prefill"])
def test_greedy_equals_greedy_without_speculation(kwargs, tiny_llama_dir, tiny_draft_dir,
                                                  reference, draft_llm):
    prompts, expected = reference
    llm = draft_llm if kwargs is None else spec_llm(tiny_llama_dir, tiny_draft_dir, **kwargs)
    before = llm.llm_engine.get_stats()
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = spec_stats(llm, before)
    # drafts were verified, some accepted and some rejected
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats[
        "spec_decode_num_draft_tokens_total"]
    if kwargs and "num_gpu_blocks_override" in kwargs:
        assert llm.llm_engine.get_stats()["num_preemptions_total"] > before[
            "num_preemptions_total"]
    assert_no_blocks_held(llm)


def test_seeded_sampling_reproduces_the_output_without_speculation(plain_llm, draft_llm):
    prompts = repetitive_prompts(21, 6)
    params = [SamplingParams(temperature=[0.3, 0.8][i % 2], seed=i, max_tokens=30, logprobs=2,
                             top_k=[0, 20][i % 2], top_p=[1.0, 0.9][i % 3 == 0],
                             repetition_penalty=1.1, min_tokens=5) for i in range(len(prompts))]
    before = draft_llm.llm_engine.get_stats()
    with_spec, without = (llm.generate(prompts, params, use_tqdm=False)
                          for llm in (draft_llm, plain_llm))
    assert_same_outputs(with_spec, without)
    assert spec_stats(draft_llm, before)["spec_decode_num_accepted_tokens_total"] > 0
    assert_no_blocks_held(draft_llm)


def test_the_target_as_its_own_draft_accepts_every_draft(tiny_llama_dir, plain_llm):
    """The draft computes exactly the target's greedy continuation; a draft off by one
    position, or proposed from stale tokens, would be rejected."""
    llm = spec_llm(tiny_llama_dir, tiny_llama_dir, k=4, max_num_batched_tokens=32)
    prompts = repetitive_prompts(22, 4) + [[5 + i for i in range(40)]]  # prefill in chunks
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = token_ids(plain_llm.generate(prompts, params, use_tqdm=False))
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    stats = llm.llm_engine.get_stats()
    drafted = stats["spec_decode_num_draft_tokens_total"]
    assert drafted >= len(prompts) * 40 * 0.5  # drafts all along (up to max_tokens)
    assert stats["spec_decode_num_accepted_tokens_total"] >= 0.97 * drafted
    assert_no_blocks_held(llm)


def test_aborts_and_no_compilation_after_warmup(tiny_llama_dir, tiny_draft_dir):
    """Warm-up compiles the step and drafting programs; serving (generate, and requests aborted
    mid-way) compiles nothing, and leaves no block held."""
    llm = spec_llm(tiny_llama_dir, tiny_draft_dir, enforce_eager=False, max_num_batched_tokens=16)
    engine = llm.llm_engine
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        llm.generate(repetitive_prompts(23, 6), mixed_params(random.Random(5), 6),
                     use_tqdm=False)
        for i, prompt in enumerate(repetitive_prompts(24, 4)):
            engine.add_request(f"abort-{i}", prompt, SamplingParams(temperature=0.0,
                                                                    max_tokens=60))
        for _ in range(6):
            engine.step()
        assert engine.get_stats()["num_free_blocks"] < engine.num_blocks - 1
        engine.abort_request([f"abort-{i}" for i in range(4)])
        engine.step()
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"
    assert engine.get_stats()["spec_decode_num_drafts_total"] > 0
    assert_no_blocks_held(llm)


def _reference_drafts(model, token_ids: list[int], k: int) -> list[int]:
    """The draft model's greedy continuation of token_ids (HF transformers, fp32)."""
    import torch

    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(k):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(token_ids):]


def test_drafts_equal_the_draft_models_greedy_continuation(tiny_llama_dir, tiny_draft_dir):
    """After every step each running request's drafts are HF's greedy continuation of its
    tokens by the draft model: the drafter's KV holds every position the target computed
    (chunked prefill, verified steps, a second round on prefix-cache hits)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_draft_dir, torch_dtype="float32")
    llm = spec_llm(tiny_llama_dir, tiny_draft_dir, max_num_batched_tokens=16)
    prompts = repetitive_prompts(25, 3) + [[5 + i for i in range(30)]]
    checked, _ = drafts_checked_after_every_step(
        llm.llm_engine, prompts, lambda tokens, n: _reference_drafts(reference, tokens, n), K)
    assert checked >= 40, checked
