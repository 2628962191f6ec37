"""Speculative decoding (n-gram drafts): config and proposer, the scheduler's grants and
rollback, the rejection sampler's distribution (chi-square against the target distribution),
and the engine: greedy and seeded output identical to the same engine without speculation,
also under chunked prefill, preemption and stop strings inside an accepted run; no compilation
after warm-up."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from conftest import CompileCounter, cpu_devices_env
from jaxllm import LLM, SamplingParams
from jaxllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.engine.args import EngineArgs
from jaxllm.sample import build_sampling_metadata, init_penalty_state
from jaxllm.sample.rejection import DraftRows, verify
from jaxllm.sample.sampler import apply_min_p, apply_top_k_top_p, sample
from jaxllm.spec_decode.ngram_proposer import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


# -- config --------------------------------------------------------------------------------------
def test_config_defaults_as_vllm():
    config = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)
    config = SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 2,
                                          "prompt_lookup_max": 3})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 3, 3)


@pytest.mark.parametrize("values, match", [
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, "'mtp' is not supported"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs 'model' for method eagle3"),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     "needs 'model' for method draft_model"),
    ({"method": "nope", "num_speculative_tokens": 2}, "Unknown speculative decoding method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be at least"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "does not support typo"),
    ("{not json", "not valid JSON"),
])
def test_config_errors(values, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(values)


def test_cli_flag_parses():
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']))
    assert SpeculativeConfig.from_dict(args.speculative_config).num_speculative_tokens == 3


# -- n-gram proposer -----------------------------------------------------------------------------
def reference_ngram(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """Brute force: the longest suffix n-gram (high..low) that occurs earlier, first occurrence."""
    for n in range(high, low - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(1, 30))]
        low = rng.randint(1, 3)
        high, k = rng.randint(low, 5), rng.randint(1, 5)
        assert (NgramProposer(k, low, high, 1000).propose(tokens)
                == reference_ngram(tokens, low, high, k)), (tokens, low, high, k)


def test_ngram_proposer_cases():
    propose = NgramProposer(3, 2, 3, 1000).propose
    assert propose([1, 2, 3, 4, 9, 2, 3]) == [4, 9, 2]  # "2 3" matched, what followed it
    assert propose([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]) == [4, 1, 2]  # longest, then first
    assert propose([1, 2, 3, 4]) == []  # no earlier occurrence
    assert NgramProposer(3, 1, 1, 5).propose([7, 8, 9, 7]) == [8]  # within max_model_len


# -- scheduler -----------------------------------------------------------------------------------
def make_scheduler(disable_by_batch_size: int = 32, max_num_batched_tokens: int = 64,
                   max_model_len: int = 64) -> Scheduler:
    spec = SpeculativeConfig.from_dict({**NGRAM, "disable_by_batch_size": disable_by_batch_size})
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=8), 64, spec)


def decoding_request(scheduler: Scheduler, request_id: str, prompt: list[int],
                     **params) -> Request:
    """A request past its prefill, its first token sampled."""
    request = Request(request_id, prompt, SamplingParams(temperature=0.0, **params))
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens})
    return request


def test_drafts_are_granted_and_rejected_ones_rolled_back():
    scheduler = make_scheduler()
    request = decoding_request(scheduler, "a", [1, 2, 3, 4, 5, 6, 7])  # 8 tokens, 7 computed
    scheduler.update_draft_token_ids({"a": [8, 9, 10]})
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {
        "a": [8, 9, 10]}
    assert out.total_num_scheduled_tokens == 4
    # positions 0..10 in blocks of 8: a second block for the drafts
    assert len(scheduler.kv_cache_manager.get_block_ids("a")) == 2
    assert request.num_computed_tokens == 11
    scheduler.update_from_output(out, {"a": [8, 11]})  # one draft accepted, then a correction
    assert list(request.output_token_ids) == [7, 8, 11]
    assert request.num_computed_tokens == 9  # the two rejected drafts' slots are rewritten
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0, 0])
    out = scheduler.schedule()  # no new drafts: a plain decode of the correction
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 9


def test_drafts_respect_budget_max_tokens_and_max_model_len():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    decoding_request(scheduler, "a", [1] * 5, max_tokens=3)  # 1 output: room for 1 draft
    scheduler.update_draft_token_ids({"a": [8, 9, 10]})
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [8]}
    scheduler.update_from_output(out, {"a": [8, 5]})
    assert scheduler.requests == {}  # finished at max_tokens=3
    scheduler = make_scheduler(max_model_len=9)
    decoding_request(scheduler, "b", [1] * 6)  # 7 tokens; at most 9: one draft + its bonus
    scheduler.update_draft_token_ids({"b": [8, 9, 10]})
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"b": [8]}


def test_stop_inside_accepted_run_and_disable_by_batch_size():
    scheduler = make_scheduler()
    request = decoding_request(scheduler, "a", [1] * 5, stop_token_ids=[9])
    scheduler.update_draft_token_ids({"a": [8, 9, 10]})
    scheduler.update_from_output(scheduler.schedule(), {"a": [8, 9, 10, 4]})
    assert list(request.output_token_ids) == [7, 8, 9] and request.stop_reason == 9
    assert scheduler.kv_cache_manager.num_free_blocks == 63  # everything back
    scheduler = make_scheduler(disable_by_batch_size=2)
    for name in "ab":
        decoding_request(scheduler, name, [1] * 5)
    scheduler.update_draft_token_ids({"a": [8], "b": [8]})
    assert not scheduler.speculation_on()
    assert scheduler.schedule().scheduled_spec_decode_tokens == {}


# -- the rejection sampler -----------------------------------------------------------------------
VOCAB = 24  # at least MAX_LOGPROBS (the COND sampler computes logprobs)


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The processed target distribution of one row, built from the sampler's own filters."""
    x = jnp.asarray(logits[None] / params.temperature)
    x = apply_min_p(x, jnp.array([params.min_p]))
    x = apply_top_k_top_p(x, jnp.array([params.top_k]), jnp.array([params.top_p]))
    return np.asarray(jax.nn.softmax(x, axis=-1))[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5, top_p=0.8)],
                         ids=["plain", "top_k_top_p"])
def test_rejection_sampler_output_follows_the_target_distribution(params):
    """One request with drafts (d0, d1) verified over 3 rows, drawn 10000 times with different
    seeds: its first token follows p0, and given d0 accepted its second token follows p1."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, VOCAB)).astype(np.float32) * 1.5
    p0, p1 = target_probs(logits[0], params), target_probs(logits[1], params)
    drafts = [int(np.argsort(p0)[-2]), int(np.argsort(p1)[-3])]  # likely, but not the mode
    draws = 10000
    num_rows = 3 * draws
    md = build_sampling_metadata([params] * num_rows, output_indices=[0, 1, 2] * draws,
                                 seeds=np.repeat(np.arange(draws), 3).tolist(),
                                 num_seqs_padded=num_rows)
    rows = DraftRows(draft_ids=jnp.tile(jnp.array(drafts + [-1]), draws),
                     row_seq=jnp.repeat(jnp.arange(draws), 3),
                     first_row=jnp.arange(draws) * 3,
                     prior_draft_ids=jnp.full((num_rows, 2), -1))

    @jax.jit
    def run(logits):
        state = init_penalty_state(1, VOCAB)
        out = sample(logits, md, state, jnp.zeros(num_rows, jnp.int32))
        verified = verify(out.token_ids, rows)
        return out.token_ids.reshape(draws, 3), verified.num_accepted
    tokens, num_accepted = map(np.asarray, run(jnp.tile(jnp.asarray(logits), (draws, 1))))
    first = np.where(num_accepted > 0, drafts[0], tokens[:, 0])
    check_distribution(first, p0)
    second = tokens[num_accepted > 0, 1]  # the second output token where d0 was accepted
    check_distribution(np.where(num_accepted[num_accepted > 0] > 1, drafts[1], second), p1)


def check_distribution(samples: np.ndarray, probs: np.ndarray) -> None:
    support = probs > 0
    assert np.all(np.isin(samples, np.flatnonzero(support))), "sampled outside the support"
    observed = np.bincount(samples, minlength=VOCAB)[support]
    probs = probs[support].astype(np.float64)
    expected = probs / probs.sum() * len(samples)
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)


def test_penalties_count_earlier_drafts():
    """Row 1 of a run sees draft d0 as an output: with a large frequency penalty, a greedy row
    whose argmax is d0 picks another token, exactly as if d0 had been generated."""
    logits = jnp.zeros((2, 32)).at[:, 1:3].set(jnp.array([2.5, 1.0]))  # "all": top-20 logprobs
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    md = build_sampling_metadata([params] * 2, output_indices=[0, 1], seeds=[0, 0],
                                 num_seqs_padded=2)
    prior = jnp.array([[-1], [1]])
    out = jax.jit(sample, static_argnums=4)(logits, md, init_penalty_state(1, 32),
                                            jnp.zeros(2, jnp.int32), "all", prior)
    assert out.token_ids.tolist() == [1, 2]


# -- the engine ----------------------------------------------------------------------------------
def repetitive_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram drafts come often (and are sometimes wrong)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 300) for _ in range(rng.randint(2, 6))]
        prompts.append(([rng.randrange(3, 300)] + phrase) * rng.randint(2, 5))
    return prompts


def mixed_params(rng: random.Random, count: int) -> list[SamplingParams]:
    """Greedy and sampled, with and without top-k and logprobs, of varied lengths: requests
    that take every sampler program a bucket has."""
    return [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]),
                           logprobs=rng.choice([None, 2]), max_tokens=rng.randint(1, 30))
            for _ in range(count)]


def make_llm(model_dir: str, speculative: bool, **kwargs) -> LLM:
    defaults = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                    num_gpu_blocks_override=64, block_size=8, compilation_cache_dir=None,
                    enforce_eager=True)
    if speculative:
        defaults["speculative_config"] = NGRAM
    return LLM(model_dir, **{**defaults, **kwargs})


def assert_same_outputs(with_spec, without) -> None:
    """Tokens, finish reasons and cumulative logprobs as without speculation."""
    assert token_ids(with_spec) == token_ids(without)
    for a, b in zip(with_spec, without):
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
        np.testing.assert_allclose(a.outputs[0].cumulative_logprob,
                                   b.outputs[0].cumulative_logprob, rtol=1e-4)


def drafts_checked_after_every_step(engine, prompts: list[list[int]], reference_drafts,
                                    k: int) -> tuple[int, int]:
    """Two rounds of the prompts, greedy (the second round hits the prefix cache): after every
    step each running request's drafts equal reference_drafts(its tokens, len(drafts)).
    -> (drafts checked, of them k long)."""
    checked = full = 0
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{round_}-{i}", prompt, SamplingParams(
                temperature=0.0, max_tokens=12, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            for request in list(engine.scheduler.running):
                drafts = request.spec_token_ids
                if drafts:
                    expected = reference_drafts(request.all_token_ids, len(drafts))
                    assert drafts == expected, (request.request_id, request.num_tokens)
                    checked += 1
                    full += len(drafts) == k
    assert engine.get_stats()["prefix_cache_hits_total"] > 0
    return checked, full


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_blocks"] == engine.num_blocks - 1


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32)


@pytest.fixture(scope="module")
def llm_pair(tiny_llama_dir) -> dict[bool, LLM]:
    """The engine without (False) and with (True) speculation; the one without is checked
    against HF transformers by test_engine.py."""
    return {spec: make_llm(tiny_llama_dir, spec, max_num_batched_tokens=32)
            for spec in (False, True)}


@pytest.fixture(scope="module")
def reference(llm_pair):
    prompts = repetitive_prompts(0, 6)
    return prompts, token_ids(llm_pair[False].generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("kwargs", [None, {"num_gpu_blocks_override": 20},
                                    {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["plain", "preemption", "chunked_prefill"])
def test_greedy_equals_greedy_without_speculation(kwargs, tiny_llama_dir, reference, llm_pair):
    prompts, expected = reference
    llm = llm_pair[True] if kwargs is None else make_llm(tiny_llama_dir, True, **kwargs)
    before = llm.llm_engine.get_stats()
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = {key: value - before[key] for key, value in llm.llm_engine.get_stats().items()
             if key.endswith("_total")}
    # drafts were verified, some accepted and some rejected (the rollback ran)
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats[
        "spec_decode_num_draft_tokens_total"]
    if kwargs and "num_gpu_blocks_override" in kwargs:
        assert stats["num_preemptions_total"] > 0
    assert_all_blocks_free(llm)


def test_async_while_the_batch_is_too_large_to_speculate(tiny_llama_dir, reference):
    """With async scheduling on, a speculating engine keeps a second step in flight only while
    disable_by_batch_size keeps speculation off, and runs synchronously (nothing left in
    flight after a step) while it speculates; tokens are greedy's through both switches."""
    prompts, expected = reference
    llm = make_llm(tiny_llama_dir, False, max_num_batched_tokens=32, speculative_config={
        **NGRAM, "disable_by_batch_size": 4})
    engine = llm.llm_engine
    lengths = [8 + 4 * i for i in range(len(prompts))]  # they finish one by one
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):  # async until 3 are left
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n,
                                                          min_tokens=n))
    left_in_flight, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        left_in_flight.append(len(engine._in_flight))
    assert [outputs[str(i)] for i in range(len(prompts))] == [
        tokens[:n] for tokens, n in zip(expected, lengths)]
    assert 1 in left_in_flight and 0 in left_in_flight
    assert engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def test_prefix_cache_hits_change_nothing(reference, llm_pair):
    """Prompts admitted on a prefix-cache hit (their second run) speculate from the cached
    blocks and still give greedy's tokens."""
    prompts, expected = reference
    engine = llm_pair[True].llm_engine
    before = engine.get_stats()["prefix_cache_hits_total"]
    for _ in range(2):
        assert token_ids(llm_pair[True].generate(prompts, GREEDY, use_tqdm=False)) == expected
    assert engine.get_stats()["prefix_cache_hits_total"] > before


_TP_CHILD = """
import json, sys
from jaxllm import LLM, SamplingParams
outs = {}
for name, kwargs in (("tp1", {}), ("tp2_ngram", dict(tensor_parallel_size=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}))):
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=32, num_gpu_blocks_override=64, block_size=8,
              enforce_eager=True, compilation_cache_dir=None, **kwargs)
    result = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=24),
                          use_tqdm=False)
    outs[name] = [o.outputs[0].token_ids for o in result]
    outs[name + "_stats"] = llm.llm_engine.get_stats().get("spec_decode_num_accepted_tokens_total")
print(json.dumps(outs))
"""


def test_tensor_parallel_speculation_equals_one_device(tiny_llama_dir):
    """n-gram speculation at TP=2 (two simulated devices, a child process: XLA_FLAGS must
    precede jax) gives one device's greedy tokens without speculation."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(cpu_devices_env(2), PYTHONPATH=root)
    prompts = repetitive_prompts(7, 4)
    done = subprocess.run([sys.executable, "-c", _TP_CHILD, tiny_llama_dir, json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    outs = json.loads(done.stdout.strip().splitlines()[-1])
    assert outs["tp2_ngram"] == outs["tp1"]
    assert outs["tp2_ngram_stats"] > 0


def test_seeded_sampling_reproduces_the_output_without_speculation(llm_pair):
    """The seed fixes each output position's draw, so speculation changes nothing: tokens,
    logprobs and finish reasons as without it (penalties, min_tokens and top-k/top-p too)."""
    prompts = repetitive_prompts(1, 6)
    params = [SamplingParams(temperature=[0.02, 0.1][i % 2], seed=i, max_tokens=30, logprobs=2,
                             top_k=[0, 20][i % 2], top_p=[1.0, 0.9][i % 3 == 0],
                             frequency_penalty=0.3 * (i % 2), repetition_penalty=1.1,
                             min_tokens=5) for i in range(len(prompts))]
    engine = llm_pair[True].llm_engine
    before = engine.get_stats()
    with_spec, without = (llm_pair[s].generate(prompts, params, use_tqdm=False)
                          for s in (True, False))
    assert_same_outputs(with_spec, without)
    after = engine.get_stats()
    accepted, drafted = (after[k] - before[k] for k in (
        "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"))
    assert 0 < accepted < drafted  # this test's own requests: some drafts taken, some not
    # low temperatures, so that drafts are taken, yet the draws decide: not greedy's tokens
    greedy = llm_pair[False].generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=30, min_tokens=5, repetition_penalty=1.1), use_tqdm=False)
    assert any(s.outputs[0].token_ids != g.outputs[0].token_ids
               for s, g in zip(with_spec, greedy))


def test_stop_strings_inside_an_accepted_run(llm_pair):
    """Stop strings cut at the token that completes them, also when it is an accepted draft
    followed by more accepted tokens in the same step: text, tokens and reasons as without
    speculation."""
    prompts = repetitive_prompts(2, 4)
    plain = llm_pair[False].generate(prompts, GREEDY, use_tqdm=False)
    params, batch = [], []
    for prompt, out in zip(prompts, plain):
        text = out.outputs[0].text
        for start in range(2, len(text) - 3, max(1, len(text) // 6)):
            params.append(SamplingParams(temperature=0.0, max_tokens=32,
                                         stop=[text[start:start + 3]]))
            batch.append(prompt)
    engine = llm_pair[True].llm_engine
    dropped = []
    process = engine.output_processor.process

    def recording(updated, logprobs):
        outputs, stopped = process(updated, logprobs)
        dropped.extend(len(r.output_token_ids) - len(o.outputs[0].token_ids)
                       for r, o in zip(updated, outputs))
        return outputs, stopped
    engine.output_processor.process = recording
    try:
        with_spec = llm_pair[True].generate(batch, params, use_tqdm=False)
    finally:
        engine.output_processor.process = process
    without = llm_pair[False].generate(batch, params, use_tqdm=False)
    for a, b in zip(with_spec, without):
        assert (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason,
                a.outputs[0].stop_reason) == (b.outputs[0].text, b.outputs[0].token_ids,
                                              b.outputs[0].finish_reason,
                                              b.outputs[0].stop_reason)
    assert max(dropped) > 0, "no stop string fell inside an accepted run"
    assert_all_blocks_free(llm_pair[True])



def test_lean_steps_verify_what_cond_steps_verify(tiny_llama_dir):
    """The cond-free programs with drafts (PLAIN for batches without penalties, ALL counting
    the accepted drafts otherwise) against the one program with conds: the same tokens."""
    prompts = repetitive_prompts(5, 8)
    plain = [SamplingParams(temperature=0.1 * (i % 2), seed=i, max_tokens=30) for i in range(8)]
    # a penalty small enough that drafts are still accepted, and counted
    penalised = [SamplingParams(temperature=0.1 * (i % 2), seed=i, max_tokens=30,
                                frequency_penalty=0.1) for i in range(8)]
    got = {}
    for lean in (False, True):
        llm = make_llm(tiny_llama_dir, True, lean_steps=lean, max_num_batched_tokens=16,
                       max_num_seqs=4)
        got[lean] = [token_ids(llm.generate(prompts, params, use_tqdm=False))
                     for params in (plain, penalised)]
        assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0
    assert got[True] == got[False]


def test_no_compilation_after_warmup(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, True, enforce_eager=False, max_num_batched_tokens=16)
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        rng = random.Random(3)
        for round_ in range(2):
            prompts = repetitive_prompts(round_ + 10, rng.randint(1, 8))
            params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]),
                                     frequency_penalty=rng.choice([0, 0.3]),
                                     logprobs=rng.choice([None, 2]),
                                     max_tokens=rng.randint(1, 30)) for _ in prompts]
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts_total"] > 0
    assert_all_blocks_free(llm)


# -- metrics and bench ---------------------------------------------------------------------------
SPEC_STATS = {"spec_decode_num_drafts_total": 4, "spec_decode_num_draft_tokens_total": 12,
              "spec_decode_num_accepted_tokens_total": 6,
              "spec_decode_num_accepted_tokens_per_pos": [3, 2, 1]}


def test_bench_prints_acceptance(capsys):
    from jaxllm.bench.spec_decode import report
    result = {}
    report(result, SPEC_STATS)
    assert result["spec_decode"]["acceptance_rate"] == 0.5
    assert result["spec_decode"]["mean_acceptance_length"] == 2.5  # 1 + 6 / 4
    assert result["spec_decode"]["acceptance_rate_per_position"] == [0.75, 0.5, 0.25]
    assert ("acceptance rate 50.0%, mean acceptance length 2.50"
            in capsys.readouterr().out)
    report(result := {}, {"num_running": 0})
    assert result == {}


def test_metrics_export_vllm_spec_decode_counters():
    from jaxllm.server.metrics import ServerMetrics
    stats = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "num_free_blocks": 1,
             "num_preemptions_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0,
             "num_aborted_total": 0}
    text = ServerMetrics("m", prefix="vllm").render({**stats, **SPEC_STATS}).body.decode()
    labels = 'engine="0",model_name="m"'
    for line in (f"vllm:spec_decode_num_drafts_total{{{labels}}} 4.0",
                 f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} 12.0",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} 6.0",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total"
                 f'{{{labels},position="2"}} 1.0'):
        assert line in text
    assert "spec_decode" not in ServerMetrics("m").render(stats).body.decode()
