"""The engine end to end against HF transformers (torch, fp32): greedy generation token for
token, under preemption and chunked prefill; no compilation after warm-up; bad input; no leaks.
The engine-level tests run with async scheduling off and on."""

from __future__ import annotations

import gc
import random

import jax
import numpy as np
import pytest

from conftest import CompileCounter
from jaxllm import LLM, SamplingParams
from jaxllm.core.scheduler import PLACEHOLDER_TOKEN_ID
from jaxllm.sampling_params import RequestOutputKind

NUM_NEW_TOKENS = 32


def hf_greedy(model_dir: str, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    """Greedy continuation by HF transformers; EOS is masked, as min_tokens does in jaxllm."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.config.eos_token_id
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(num_new_tokens):  # full recompute: no reliance on HF's cache API
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                logits[eos] = -float("inf")
                ids.append(int(torch.argmax(logits)))
            outputs.append(ids[len(prompt):])
    return outputs


def random_prompts(seed: int, count: int, vocab: int, lengths=(3, 45)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def greedy(num_tokens: int = NUM_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, min_tokens=num_tokens)


def make_llm(model_dir: str, **kwargs) -> LLM:
    defaults = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                    num_gpu_blocks_override=64, block_size=8, compilation_cache_dir=None)
    return LLM(model_dir, **{**defaults, **kwargs})


class PlaceholderCounter:
    """Counts the placeholder tokens the engine's launched steps carried: async scheduling must
    really launch steps before their inputs' last tokens are known, and sync never."""

    def __init__(self, llm: LLM):
        self.count = 0
        runner = llm.llm_engine.runner
        launch = runner.launch

        def counting_launch(scheduler_output):
            launched = launch(scheduler_output)
            self.count += sum(c.token_ids.count(PLACEHOLDER_TOKEN_ID) for c in launched.chunks)
            return launched
        runner.launch = counting_launch

    def check(self, llm: LLM) -> None:
        assert (self.count > 0) == llm.llm_engine.async_scheduling, self.count


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_blocks"] == engine.num_blocks - 1


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dirs):
    prompts = random_prompts(0, 6, 300)
    return prompts, {kind: hf_greedy(d, prompts, NUM_NEW_TOKENS)
                     for kind, d in tiny_model_dirs.items()}


@pytest.mark.parametrize("kind, async_scheduling", [
    ("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True)])
def test_greedy_matches_hf(kind, async_scheduling, tiny_model_dirs, hf_reference):
    prompts, expected = hf_reference
    llm = make_llm(tiny_model_dirs[kind], enforce_eager=True, async_scheduling=async_scheduling)
    placeholders = PlaceholderCounter(llm)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[kind]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    placeholders.check(llm)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_matches_hf_under_preemption(async_scheduling, tiny_model_dirs, hf_reference):
    prompts, expected = hf_reference
    # 6 prompts of up to 45 + 32 tokens in 8-token blocks need ~60 blocks at once: 20 forces
    # the newest running requests out and back in (recompute).
    llm = make_llm(tiny_model_dirs["llama"], num_gpu_blocks_override=20, enforce_eager=True,
                   async_scheduling=async_scheduling)
    placeholders = PlaceholderCounter(llm)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected["llama"]
    assert llm.llm_engine.get_stats()["num_preemptions_total"] > 0
    placeholders.check(llm)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_matches_hf_with_chunked_prefill(async_scheduling, tiny_model_dirs, hf_reference):
    prompts, expected = hf_reference
    # A budget of 8 tokens per step chunks every prompt longer than 8 (and most are).
    llm = make_llm(tiny_model_dirs["llama"], max_num_batched_tokens=8, max_num_seqs=4,
                   enforce_eager=True, async_scheduling=async_scheduling)
    placeholders = PlaceholderCounter(llm)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected["llama"]
    placeholders.check(llm)
    assert_all_blocks_free(llm)



def plain_params(rng: random.Random) -> SamplingParams:
    """What a lean step can serve: no penalties, no top-k/top-p, no logprobs."""
    return SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), min_p=rng.choice([0.0, 0.1]),
                          seed=rng.choice([None, 7]), n=rng.choice([1, 2]),
                          max_tokens=rng.randint(1, 40))


def uses_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1 or params.presence_penalty != 0
            or params.frequency_penalty != 0)


def record_programs(llm) -> list[tuple[str, bool]]:
    """Which program (sampler stages) each dispatched step ran, and whether the step computed
    tokens of a request that uses penalties."""
    runner, programs = llm.llm_engine.runner, []
    dispatch = runner._dispatch

    def recording(inputs, stages="cond"):
        rows = set(inputs.token_rows.tolist())
        programs.append((stages, any(uses_penalties(s.sampling_params)
                                     for s in runner.requests.states.values() if s.row in rows)))
        return dispatch(inputs, stages)
    runner._dispatch = recording
    return programs


@pytest.mark.parametrize("async_scheduling, lean_steps", [(False, False), (True, True)])
def test_no_compilation_after_warmup(async_scheduling, lean_steps, tiny_llama_dir):
    # warm-up on
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=32, async_scheduling=async_scheduling,
                   lean_steps=lean_steps)
    programs = record_programs(llm)
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        rng = random.Random(1)
        prompts = random_prompts(9, 8, 300, lengths=(1, 60))
        llm.generate(prompts, [plain_params(rng) for _ in prompts], use_tqdm=False)
        llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for round_ in range(3):
            prompts = random_prompts(round_ + 10, rng.randint(1, 12), 300, lengths=(1, 60))
            params = [SamplingParams(
                temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5, 50]),
                top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.1]),
                repetition_penalty=rng.choice([1.0, 1.2]), presence_penalty=rng.choice([0, 0.5]),
                frequency_penalty=rng.choice([0, 0.3]), seed=rng.choice([None, 7]),
                logprobs=rng.choice([None, 3]), prompt_logprobs=rng.choice([None, None, 2]),
                n=rng.choice([1, 2]),
                max_tokens=rng.randint(1, 40)) for _ in prompts]
            llm.generate(prompts, params, use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"
    assert {stages for stages, _ in programs} == ({"greedy", "plain", "all"} if lean_steps
                                                  else {"cond"})
    assert_all_blocks_free(llm)


def test_step_buckets():
    from jaxllm.worker.model_runner import step_buckets

    assert step_buckets(64, 4, one_token=False, decode=False) == [16, 32, 64]
    assert step_buckets(64, 4, one_token=False, decode=True) == [4, 16, 32, 64]
    assert step_buckets(64, 4, one_token=True, decode=True) == [1, 4, 16, 32, 64]
    assert step_buckets(64, 1, one_token=True, decode=True) == [1, 16, 32, 64]
    assert step_buckets(64, 16, one_token=False, decode=True) == [16, 32, 64]
    assert step_buckets(8, 4, one_token=False, decode=True) == [4, 8]


def test_decode_bucket_takes_the_decode_steps(tiny_llama_dir, monkeypatch):
    """The decode bucket (a GPU's default; forced here): with max_num_seqs 4 a step of four
    decodes runs in a 4-token bucket, prompts in the larger ones; the warm-up compiles it, so
    nothing compiles while generating, and the greedy tokens equal those of an engine
    without it."""
    import functools

    from jaxllm.engine import builder
    from jaxllm.worker.model_runner import ModelRunner

    prompts = random_prompts(31, 6, 300, lengths=(2, 30))
    kw = dict(max_num_seqs=4, max_num_batched_tokens=32)
    want = make_llm(tiny_llama_dir, enforce_eager=True, **kw).generate(
        prompts, greedy(12), use_tqdm=False)
    monkeypatch.setattr(builder, "ModelRunner", functools.partial(ModelRunner, decode_bucket=True))
    llm = make_llm(tiny_llama_dir, **kw)
    runner = llm.llm_engine.runner
    assert runner.buckets == [4, 16, 32]
    bucket_for, used = runner.bucket_for, []
    runner.bucket_for = lambda n: used.append((n, bucket_for(n)[0])) or bucket_for(n)
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        got = llm.generate(prompts, greedy(12), use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert (4, 4) in used and any(bucket > 4 for _, bucket in used)
    assert all(bucket == 4 for n, bucket in used if n <= 4)
    assert_all_blocks_free(llm)


def test_lean_steps_generate_what_cond_steps_generate(tiny_llama_dir):
    """The cond-free programs (and prompt logprobs after the step) against the one program
    with conds: the same tokens, logprobs and prompt logprobs. PLAIN leaves the penalty state
    be. Requests with penalties whose prompts take several steps run beside requests that
    sample in those steps: every step a penalty request is in must run ALL (the first resets
    its row, each records a chunk of its prompt), though it samples in the last only. The
    requests outnumber the rows, some are preempted, and resumed requests and repeated
    prompts hit the prefix cache. All-greedy batches (min_tokens masking the stop ids) run
    GREEDY."""
    rng = random.Random(3)
    prompts = random_prompts(21, 6, 300, lengths=(2, 40))
    params = [plain_params(rng) for _ in prompts]
    for p in params:
        p.seed = 5 if p.seed is None else p.seed  # unseeded draws differ between engines
    long_prompts = random_prompts(22, 3, 300, lengths=(50, 80))
    penalised = [SamplingParams(temperature=0, repetition_penalty=2.0, max_tokens=16),
                 SamplingParams(temperature=0.9, seed=2, repetition_penalty=1.5,
                                frequency_penalty=1.5, max_tokens=16),
                 SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=0.5,
                                max_tokens=16)]
    filtered = [SamplingParams(temperature=0.8, top_p=0.7, top_k=9, logprobs=3, seed=1,
                               max_tokens=12),
                SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=5)]
    got = {}
    for lean in (False, True):
        llm = make_llm(tiny_llama_dir, enforce_eager=True, lean_steps=lean,
                       max_num_batched_tokens=16, num_gpu_blocks_override=24)
        programs, runner = record_programs(llm), llm.llm_engine.runner
        before = jax.tree.map(np.array, runner.state.penalty_state)
        runs = [llm.generate(prompts, params, use_tqdm=False)]
        after = jax.tree.map(np.array, runner.state.penalty_state)
        runs += [llm.generate(prompts + long_prompts * 2, params + penalised * 2,
                              use_tqdm=False),
                 llm.generate(prompts[:2], filtered, use_tqdm=False),
                 llm.generate(prompts[2:5] + long_prompts,
                              SamplingParams(temperature=0, min_tokens=3, max_tokens=6),
                              use_tqdm=False)]
        got[lean] = [[(c.token_ids, c.logprobs) for c in o.outputs] + [o.prompt_logprobs]
                     for run in runs for o in run]
        if lean:  # PLAIN (the saving) wherever no request uses penalties
            assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before, after)))
            assert {stages for stages, penalties in programs if penalties} == {"all"}
            assert {"plain", "greedy"} <= {stages for stages, penalties in programs
                                           if not penalties}
        else:
            assert {stages for stages, _ in programs} == {"cond"}
        assert_all_blocks_free(llm)
    assert got[True] == got[False]
@pytest.fixture(scope="module")
def llms(tiny_llama_dir) -> dict[bool, LLM]:
    """async_scheduling -> an engine, shared by the tests below."""
    return {mode: make_llm(tiny_llama_dir, enforce_eager=True, async_scheduling=mode)
            for mode in (False, True)}


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def llm(request, llms):
    return llms[request.param]


def test_seeded_sampling_ignores_batch_composition(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12)
    target = [5, 17, 42, 99, 7]
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(5, 5, 300)
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=0.8, seed=None, max_tokens=20)] * 2
                         + [params] + [SamplingParams(temperature=0.0, max_tokens=5)] * 3,
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone


def test_n_and_logprobs(llm):
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6,
                                                      logprobs=2), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert len(completion.token_ids) == 6 and len(completion.logprobs) == 6
        for token, step in zip(completion.token_ids, completion.logprobs):
            assert token in step and all(lp.logprob <= 0 for lp in step.values())
        assert completion.cumulative_logprob == pytest.approx(
            sum(step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs)),
            rel=1e-5)
    assert_all_blocks_free(llm)


def test_n_children_take_turns_with_later_requests_and_greedy_is_unchanged(
        llm, tiny_llama_dir, monkeypatch):
    """The children of an n > 1 request take turns with requests that arrive after it
    (jaxllm/core/waiting_queue.py); the reordering changes no greedy output."""
    from jaxllm.engine.output_processor import child_request_id

    prompts = random_prompts(7, 3, 300)
    expected = hf_greedy(tiny_llama_dir, prompts, 8)
    scheduler, admitted = llm.llm_engine.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        admitted.extend(r.request_id for r in out.scheduled_new_reqs)
        return out
    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    params = [SamplingParams(n=6, temperature=0.0, max_tokens=8, min_tokens=8), greedy(8),
              greedy(8)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [c.token_ids for c in outputs[0].outputs] == [expected[0]] * 6
    assert [o.outputs[0].token_ids for o in outputs[1:]] == expected[1:]
    parent, later, last = (o.request_id for o in outputs)
    assert admitted[:4] == [child_request_id(parent, 0, 6), later, last,
                            child_request_id(parent, 1, 6)]
    assert_all_blocks_free(llm)


def test_final_only_outputs_once_and_generate_leaves_params_alone(llm):
    """FINAL_ONLY (what LLM.generate asks for) yields one output, when the last child ends, equal
    to the final CUMULATIVE one; the caller's params keep their kind."""
    engine = llm.llm_engine
    kinds = {"cumulative": RequestOutputKind.CUMULATIVE, "final": RequestOutputKind.FINAL_ONLY}
    for request_id, kind in kinds.items():
        engine.add_request(request_id, [5, 6, 7], SamplingParams(
            n=2, temperature=0.0, max_tokens=4 + len(request_id), output_kind=kind))
    seen = {request_id: [] for request_id in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["cumulative"]) > 1 and [o.finished for o in seen["final"]] == [True]
    final, cumulative = seen["final"][0], seen["cumulative"][-1]
    assert [len(c.token_ids) for c in final.outputs] == [9, 9]
    assert [c.token_ids[:4] for c in final.outputs] == [c.token_ids[:4]
                                                        for c in cumulative.outputs]
    params = greedy(3)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    assert_all_blocks_free(llm)


def test_stop_token_ids_and_max_tokens(llm):
    first = llm.generate([[9, 10, 11]], greedy(8), use_tqdm=False)[0].outputs[0]
    stop_at = first.token_ids[3]
    out = llm.generate([[9, 10, 11]], SamplingParams(temperature=0, max_tokens=8,
                                                     stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first.token_ids[:first.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1] * 129, SamplingParams(), "maximum model length of 128"),
    ([1, 10**6], SamplingParams(), "out of vocabulary"),
])
def test_bad_input_raises_and_leaks_nothing(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[3, 4, 5], prompt], params, use_tqdm=False)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(temperature=-1.0), "temperature must be non-negative"),
    (dict(output_kind=RequestOutputKind.DELTA), "output_kind DELTA is not supported"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_attention_backend_names():
    from jaxllm.config import RunnerConfig
    from jaxllm.models.attention import attention_backend as _attention_backend
    for name in ("auto", "pallas", "triton", "mosaic", "xla"):
        RunnerConfig(attention_backend=name)
    with pytest.raises(ValueError, match="auto, pallas, triton, mosaic or xla"):
        RunnerConfig(attention_backend="flash")
    attn, _ = _attention_backend("triton")
    assert attn.keywords == {"implementation": "triton"}
    assert _attention_backend("pallas")[0].keywords == {"implementation": None}


def test_model_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "missing"))


def test_max_model_len_that_does_not_fit(tiny_llama_dir):
    with pytest.raises(ValueError, match="estimated maximum model length is 32"):
        make_llm(tiny_llama_dir, num_gpu_blocks_override=5, block_size=8, enforce_eager=True)


def test_abort_frees_blocks(llm):
    engine = llm.llm_engine
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(3, 20)), SamplingParams(max_tokens=50, n=2))
    for _ in range(3):
        engine.step()
    assert engine.get_stats()["num_free_blocks"] < engine.num_blocks - 1
    engine.abort_request(["a", "b"])
    assert_all_blocks_free(llm)
    assert engine.step() == []
    np.testing.assert_equal(engine.has_unfinished_requests(), False)


def test_running_requests_give_a_full_collection_little_to_walk(llm):
    """Token ids are kept in C int arrays, not lists: a full garbage collection visits every
    element of a list, and while serving such a pause outlasts the step it delays."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=30, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = random_prompts(9, 4, 300, lengths=(88, 92))
    request_ids = [str(index) for index in range(len(prompts))]

    def run_some_steps():  # admitted, prefilled, half decoded
        for request_id, prompt in zip(request_ids, prompts):
            engine.add_request(request_id, prompt, params)
        for _ in range(25):
            engine.step()

    def references_walked() -> int:  # what a full collection visits (not the frozen start-up)
        gc.collect()
        return sum(len(gc.get_referents(obj)) for obj in gc.get_objects())

    for _ in range(2):  # what the steps compile and cache, outside the count
        run_some_steps()
        engine.abort_request(request_ids)
    before = references_walked()
    run_some_steps()
    walked = references_walked() - before
    engine.abort_request(request_ids)
    assert_all_blocks_free(llm)
    # 250-380 here: ~60-100 references a request (its objects' fields, block ids and hashes),
    # none a token; as lists, the prompts held by the request, its tokens so far, the runner's
    # state and the output's copy: 780 (async) to 1,830 (sync)
    assert walked < 3 * sum(map(len, prompts)) // 2, walked


def test_serving_steps_set_off_few_garbage_collections(llm):
    """A step allocates thousands of objects that die within a step or two: at Python's default
    young threshold they set off young collections every step, which promote the live ones and
    so, in time, full collections. The engine raises the threshold."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=40, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    generations = []

    def record(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        for index, prompt in enumerate(random_prompts(11, 9, 300, lengths=(20, 60))):
            engine.add_request(f"gc-{index}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        gc.callbacks.remove(record)
    assert_all_blocks_free(llm)
    assert len(generations) <= 2, generations  # 108 young ones at Python's default


def test_an_aborted_id_used_again_while_its_step_is_in_flight(llm):
    """Aborting leaves the async engine's last step in flight; a new request under the same id
    must not take that step's token as its own (vLLM lets an aborted id be used again)."""
    engine = llm.llm_engine
    prompt = random_prompts(3, 1, 300, lengths=(20, 20))[0]
    want = llm.generate([prompt], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):
        engine.add_request("again", prompt, greedy(8))
        for _ in range(4):
            engine.step()
        engine.abort_request(["again"])
    engine.add_request("again", prompt, greedy(8))
    got = []
    while engine.has_unfinished_requests():
        got = [o.outputs[0].token_ids for o in engine.step() if o.finished] or got
    assert got == [want]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_match_hf(async_scheduling, tiny_llama_dir):
    """Prompt logprobs (computed chunk by chunk: the budget splits the prompt) against HF's
    log_softmax at every prompt position."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(7, 1, 300, lengths=(30, 30))[0]
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=16, enforce_eager=True,
                   async_scheduling=async_scheduling)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1).numpy()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        expected = ref[position - 1]
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(expected[token], abs=1e-4)
        assert entry[token].rank == int((expected >= expected[token]).sum())
        top3 = np.argsort(-expected)[:3]
        assert all(entry[int(t)].logprob == pytest.approx(expected[t], abs=1e-4) for t in top3)
    assert_all_blocks_free(llm)


def test_async_scheduling_matches_sync_with_penalties_seeds_and_stop_strings(llms):
    """Penalties count the placeholder tokens the device filled in, seeds fold in the right
    output index, and a stop string found after the next step was launched voids its token."""
    prompts = random_prompts(11, 5, 300, lengths=(3, 20))
    text = llms[False].generate([prompts[3]], greedy(12), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 3]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.5,
                       frequency_penalty=0.7, presence_penalty=0.5),
        SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=20, frequency_penalty=1.0),
        SamplingParams(temperature=0.8, seed=5, min_tokens=6, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]),
        SamplingParams(temperature=1.2, n=2, seed=3, max_tokens=9, presence_penalty=1.0),
    ]
    results = {}
    for mode, llm in llms.items():
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                          c.cumulative_logprob) for o in outputs for c in o.outputs]
        assert_all_blocks_free(llm)
    assert results[True] == results[False]
    assert results[True][3][2:4] == ("stop", stop)
