"""Scheduler: grants, chunked prefill, limits, preemption, aborts, stops, async scheduling's
placeholders, and a randomised run in sync and async order."""

import random
from dataclasses import dataclass

import pytest

from jaxllm.config import CacheConfig, SchedulerConfig
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import PLACEHOLDER_TOKEN_ID as PH
from jaxllm.core.scheduler import Scheduler, SchedulerOutput
from jaxllm.core.waiting_queue import WaitingQueue
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker.request_states import RequestStates


@dataclass
class Grant:
    """One scheduled request as the runner sees it after applying the step contract."""
    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    new_block_ids: list[int]  # a new request's whole table, else the blocks added
    samples: bool
    next_token_id: int
    sampling_params: SamplingParams
    is_new: bool


@dataclass
class Step:
    """A SchedulerOutput and the grants the runner derives from it."""
    out: SchedulerOutput
    scheduled: list[Grant]

    def __getattr__(self, name):
        return getattr(self.out, name)


class RunnerViewScheduler(Scheduler):
    """A Scheduler whose outputs pass through the runner's RequestStates, as in the engine, so
    the tests check the tokens, positions and blocks the runner computes from the deltas."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.states = RequestStates(self.max_num_seqs * 4, 64)

    def schedule(self) -> Step:
        out = super().schedule()
        blocks = {r.request_id: r.block_ids for r in out.scheduled_new_reqs}
        blocks.update({r.request_id: r.new_block_ids for r in out.scheduled_cached_reqs})
        return Step(out, [Grant(c.state.request_id, c.token_ids, c.start,
                                c.state.num_prompt_tokens, c.num_output_tokens,
                                blocks[c.state.request_id], c.samples, c.next_token_id,
                                c.state.sampling_params, c.state.request_id in
                                {r.request_id for r in out.scheduled_new_reqs})
                          for c in self.states.apply(out)])

    def update_from_output(self, step: Step, sampled: dict[str, int]):
        # The runner returns tokens only for the grants that sample.
        tokens = {g.request_id: [sampled[g.request_id]] for g in step.scheduled if g.samples}
        for request_id, token_ids in tokens.items():
            self.states.record_sampled(request_id, token_ids)
        return super().update_from_output(step.out, tokens)


def make_scheduler(num_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=64, enable_prefix_caching=False):
    """Prefix caching off unless asked: these tests pin exact grants and block ids
    (tests/test_prefix_caching.py has caching's)."""
    return RunnerViewScheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens,
                                               max_model_len),
                               CacheConfig(block_size=block_size,
                                           enable_prefix_caching=enable_prefix_caching),
                               num_blocks)


def make_request(request_id, num_prompt_tokens, **params):
    prompt = [1000 + 10 * len(request_id) + i for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(**params))


def grants(scheduler, output):
    """(id, first position, number of tokens, block table, samples) per scheduled request,
    right after schedule()."""
    tables = scheduler.kv_cache_manager
    return [(s.request_id, s.num_computed_tokens, len(s.token_ids),
             tables.get_block_ids(s.request_id), s.samples) for s in output.scheduled]


def sample_all(scheduler, output, token_id=5):
    return scheduler.update_from_output(
        output, {s.request_id: token_id for s in output.scheduled})


def test_chunked_prefill_grants_and_batch_order():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    a, b = make_request("a", 20, max_tokens=4), make_request("b", 6, max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("a", 0, 8, [1], False)]
    assert out.scheduled[0].token_ids == list(a.prompt_token_ids[0:8])
    assert a.num_computed_tokens == 8
    assert sample_all(scheduler, out) == [] and list(a.output_token_ids) == []  # a partial prefill
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("a", 8, 8, [1, 2], False)]
    sample_all(scheduler, out)
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("a", 16, 4, [1, 2, 3], True), ("b", 0, 4, [4], False)]
    assert out.total_num_scheduled_tokens == 8
    assert out.scheduled[1].token_ids == list(b.prompt_token_ids[:4])
    assert sample_all(scheduler, out, token_id=9) == [a] and list(a.output_token_ids) == [9]
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("a", 20, 1, [1, 2, 3], True), ("b", 4, 2, [4], True)]
    assert out.scheduled[0].token_ids == [9] and out.scheduled[0].num_output_tokens == 1
    assert out.scheduled[0].num_prompt_tokens == 20


def test_max_num_seqs_limits_admissions():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    for request_id, max_tokens in (("a", 1), ("b", 5), ("c", 5)):
        scheduler.add_request(make_request(request_id, 3, max_tokens=max_tokens))
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    sample_all(scheduler, out)  # a reaches max_tokens=1
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("b", 3, 1, [2], True), ("c", 0, 3, [3], True)]
    assert out.finished_req_ids == {"a"}


def test_max_num_batched_tokens_chunks_the_last_admission():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 4))
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("a", 0, 4, [1], True), ("b", 0, 4, [2], True),
                                      ("c", 0, 2, [3], False)]
    assert out.total_num_scheduled_tokens == 10
    sample_all(scheduler, out)
    out = scheduler.schedule()  # decodes first, then the rest of c's prompt
    assert grants(scheduler, out) == [("a", 4, 1, [1], True), ("b", 4, 1, [2], True),
                                      ("c", 2, 2, [3], True)]


def test_preemption_frees_the_newest_request_and_requeues_it_at_the_front():
    scheduler = make_scheduler(num_blocks=5)  # 4 usable blocks of 8 tokens
    a, b = make_request("a", 16, max_tokens=3), make_request("b", 9, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("a", 0, 16, [1, 2], True), ("b", 0, 9, [3, 4], True)]
    sample_all(scheduler, out, token_id=11)
    scheduler.add_request(make_request("c", 2))  # waits behind the preempted b
    out = scheduler.schedule()
    # a's 17th token needs a block: b, the newest, is preempted; its blocks return tail first.
    assert grants(scheduler, out) == [("a", 16, 1, [1, 2, 4], True)]
    assert out.scheduled[0].new_block_ids == [4]
    assert out.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and scheduler.num_preemptions_total == 1
    assert list(scheduler.waiting) == [b, scheduler.requests["c"]]
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids() == [3]
    sample_all(scheduler, out, token_id=12)
    out = scheduler.schedule()  # b needs 2 blocks, 1 is free: it waits
    assert grants(scheduler, out) == [("a", 17, 1, [1, 2, 4], True)]
    assert out.preempted_req_ids == set()
    assert out.scheduled[0].new_block_ids == []
    sample_all(scheduler, out, token_id=13)  # a reaches max_tokens
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    # b recomputes its prompt and its sampled token; a's blocks came back as [3, 4, 2, 1].
    assert grants(scheduler, out) == [("b", 0, 10, [3, 4], True), ("c", 0, 2, [2], True)]
    assert [s.new_block_ids for s in out.scheduled] == [[3, 4], [2]]
    assert out.scheduled[0].token_ids == list(b.prompt_token_ids) + [11]
    assert out.scheduled[0].num_output_tokens == 1 and b.status == RequestStatus.RUNNING


def test_a_request_that_is_itself_the_newest_preempts_itself():
    scheduler = make_scheduler(num_blocks=3)  # 2 usable blocks
    scheduler.add_request(make_request("a", 7, max_tokens=2))
    scheduler.add_request(make_request("b", 8, max_tokens=2))
    sample_all(scheduler, scheduler.schedule())
    out = scheduler.schedule()
    assert grants(scheduler, out) == [("a", 7, 1, [1], True)] and out.preempted_req_ids == {"b"}
    assert scheduler.kv_cache_manager.block_pool.free_block_queue.block_ids() == [2]
    assert [r.request_id for r in scheduler.waiting] == ["b"]


def test_abort_waiting_and_running_requests_frees_everything():
    scheduler = make_scheduler(num_blocks=9, max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 12))
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert scheduler.kv_cache_manager.num_free_blocks == 4
    scheduler.finish_requests(["c", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    # b was aborted between schedule() and update_from_output(): its token is dropped.
    assert sample_all(scheduler, out) == [scheduler.requests["a"]]
    scheduler.finish_requests("a", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests() and scheduler.num_running == 0
    out = scheduler.schedule()
    assert out.scheduled == [] and out.finished_req_ids == {"a", "b", "c"}
    assert scheduler.schedule().finished_req_ids == set()
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def make_children(parent_id, n, num_prompt_tokens, **params):
    """The n child requests of one request, as EngineCore makes them."""
    prompt = [2000 + i for i in range(num_prompt_tokens)]
    return [Request(f"{parent_id}#{i}", prompt, SamplingParams(**params),
                    parent_request_id=parent_id) for i in range(n)]


def test_parents_take_turns_and_keep_their_order():
    scheduler = make_scheduler(max_num_seqs=16, max_num_batched_tokens=64)
    for request in [*make_children("a", 4, 3), *make_children("b", 3, 3), make_request("c", 3)]:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == [
        "a#0", "b#0", "c", "a#1", "b#1", "a#2", "b#2", "a#3"]


def test_an_n_128_request_does_not_hold_back_a_later_request():
    """Strict FCFS would admit "late" after all 128 children (16 steps or more, at most 8
    prompts a step); it goes right after the first child, and the children still go in order."""
    scheduler = make_scheduler(num_blocks=400, max_num_seqs=256, max_num_batched_tokens=256)
    for request in [*make_children("big", 128, 32, max_tokens=4), make_request("late", 32)]:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled][:3] == ["big#0", "late", "big#1"]
    admitted = [s.request_id for s in out.scheduled]
    while len(admitted) < 129:
        sample_all(scheduler, out)
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= 256
        admitted += [s.request_id for s in out.scheduled if s.is_new]
    assert [i for i in admitted if i != "late"] == [f"big#{i}" for i in range(128)]


def test_a_parent_over_max_loras_waits_whole_and_later_parents_go():
    from jaxllm.lora.request import LoRARequest

    scheduler = Scheduler(SchedulerConfig(8, 64, 64), CacheConfig(block_size=8,
                                                                   enable_prefix_caching=False),
                          64, None, 1)
    first = make_request("first", 3)
    first.lora_request = LoRARequest("one", 1, "/one")
    scheduler.add_request(first)
    assert [r.request_id for r in scheduler.schedule().scheduled_new_reqs] == ["first"]
    other = make_children("other", 2, 3)  # a second adapter: over max_loras=1 while first runs
    for child in other:
        child.lora_request = LoRARequest("two", 2, "/two")
    for request in [*other, make_request("base", 3)]:
        scheduler.add_request(request)
    assert [r.request_id for r in scheduler.schedule().scheduled_new_reqs] == ["base"]
    assert list(scheduler.waiting) == other


def test_waiting_queue_preempted_first_removal_and_skipped_groups():
    queue = WaitingQueue()
    a, b = make_children("a", 3, 2), make_children("b", 2, 2)
    for request in [*a, *b]:
        queue.append(request)
    assert len(queue) == 5 and queue.first() is a[0]
    assert queue.popleft() is a[0]  # admitted: a's next child waits behind b
    queue.appendleft(a[0])  # preempted: first again, whatever its parent
    assert list(queue) == [a[0], *b, a[1], a[2]]
    assert queue.popleft() is a[0] and queue.first() is b[0]
    skipped = [queue.popleft_group()]  # b cannot be admitted this step: both its children wait
    assert len(queue) == 2 and queue.first() is a[1]
    queue.extendleft_groups(skipped)
    assert list(queue) == [*b, a[1], a[2]] and len(queue) == 4
    queue.remove(a[1])
    queue.remove(b[0])
    queue.remove(b[1])  # b's group is gone
    assert list(queue) == [a[2]] and len(queue) == 1
    with pytest.raises(ValueError, match="not waiting"):
        queue.remove(b[1])
    queue.append(make_request("c", 2))  # another parent: a group of its own
    assert [r.request_id for r in (queue.popleft(), queue.popleft())] == ["a#2", "c"]
    assert len(queue) == 0 and not queue


def run_to_finish(scheduler, request, token_ids):
    """Feeds token_ids one per step; returns the finished request's output tokens."""
    scheduler.add_request(request)
    tokens = iter(token_ids)
    while not request.is_finished():
        out = scheduler.schedule()
        scheduler.update_from_output(out, {s.request_id: next(tokens) for s in out.scheduled})
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_gpu_blocks - 1
    return list(request.output_token_ids)


@pytest.mark.parametrize("params, tokens, expected_output, status, stop_reason", [
    (dict(max_tokens=3), [7, 7, 7, 7], [7, 7, 7], RequestStatus.FINISHED_LENGTH_CAPPED, None),
    (dict(stop_token_ids=[7], min_tokens=2), [7, 7, 3], [7, 7], RequestStatus.FINISHED_STOPPED, 7),
    (dict(max_tokens=2, stop_token_ids=[7]), [3, 7], [3, 7],
     RequestStatus.FINISHED_LENGTH_CAPPED, None),  # length is checked first, as vLLM
    (dict(all_stop_token_ids={2}), [3, 2, 4], [3, 2], RequestStatus.FINISHED_STOPPED, None),
    (dict(all_stop_token_ids={2}, min_tokens=2), [2, 2, 4], [2, 2],
     RequestStatus.FINISHED_STOPPED, None),
    (dict(all_stop_token_ids={2}, ignore_eos=True, max_tokens=3), [2, 2, 2, 2], [2, 2, 2],
     RequestStatus.FINISHED_LENGTH_CAPPED, None),
    (dict(max_tokens=None), list(range(20, 40)), list(range(20, 26)),
     RequestStatus.FINISHED_LENGTH_CAPPED, None),  # 10 prompt + 6 = max_model_len
])
def test_stop_conditions(params, tokens, expected_output, status, stop_reason):
    scheduler = make_scheduler(max_model_len=16)
    request = make_request("r", 10, **params)
    assert run_to_finish(scheduler, request, tokens) == expected_output
    assert request.status == status and request.stop_reason == stop_reason


def test_prompt_of_max_model_len_gets_one_token():
    scheduler = make_scheduler(max_model_len=16)
    assert run_to_finish(scheduler, make_request("r", 16, max_tokens=8), [4, 4]) == [4]


def test_add_request_rejects_bad_requests():
    scheduler = make_scheduler(num_blocks=5, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(make_request("a", 0))
    with pytest.raises(ValueError, match="maximum model length of 64"):
        scheduler.add_request(make_request("a", 65))
    with pytest.raises(ValueError, match="needs 5 KV cache blocks .* 33 tokens.* 4 usable"):
        scheduler.add_request(make_request("a", 20, max_tokens=14))
    scheduler.add_request(make_request("a", 20, max_tokens=13))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("a", 3))
    assert scheduler.get_num_unfinished_requests() == 1 and scheduler.num_waiting == 1


# ---- async scheduling: schedule() for step N+1 comes before update_from_output() of step N ----

def test_async_decode_grants_placeholders_with_exact_tokens_and_blocks():
    scheduler = make_scheduler()
    a = make_request("a", 7, max_tokens=5)
    scheduler.add_request(a)
    out1 = scheduler.schedule()
    assert grants(scheduler, out1) == [("a", 0, 7, [1], True)] and a.num_output_placeholders == 1
    out2 = scheduler.schedule()  # step 1 in flight: a decodes the token step 1 samples
    assert grants(scheduler, out2) == [("a", 7, 1, [1], True)]
    assert out2.scheduled[0].token_ids == [PH] and out2.scheduled[0].num_output_tokens == 1
    assert out2.scheduled[0].new_block_ids == [] and out2.scheduled[0].next_token_id == -1
    assert a.num_output_placeholders == 2 and list(a.output_token_ids) == []
    assert scheduler.update_from_output(out1, {"a": 11}) == [a]
    assert list(a.output_token_ids) == [11] and a.num_output_placeholders == 1
    out3 = scheduler.schedule()  # position 8 opens the second block
    assert grants(scheduler, out3) == [("a", 8, 1, [1, 2], True)]
    assert out3.scheduled[0].token_ids == [PH] and out3.scheduled[0].new_block_ids == [2]
    assert out3.scheduled[0].num_output_tokens == 2
    scheduler.update_from_output(out2, {"a": 12})
    assert list(a.all_token_ids) == [*a.prompt_token_ids, 11, 12] and a.num_output_placeholders == 1


def test_async_eos_finish_drops_the_placeholder_and_frees_blocks():
    scheduler = make_scheduler()
    a = make_request("a", 8, max_tokens=10, all_stop_token_ids={2})
    scheduler.add_request(a)
    out1 = scheduler.schedule()
    out2 = scheduler.schedule()  # a's decode at position 8 takes a second block
    assert grants(scheduler, out2) == [("a", 8, 1, [1, 2], True)]
    assert scheduler.update_from_output(out1, {"a": 2}) == [a]  # EOS
    assert a.status == RequestStatus.FINISHED_STOPPED and a.num_output_placeholders == 0
    assert scheduler.num_running == 0 and not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_gpu_blocks - 1
    out3 = scheduler.schedule()
    assert out3.scheduled == [] and out3.finished_req_ids == {"a"}
    assert scheduler.update_from_output(out2, {"a": 7}) == []  # the in-flight token is void
    assert list(a.output_token_ids) == [2]


def run_async_to_finish(scheduler, request, token_ids):
    """As run_to_finish, but each schedule() comes before the previous step's update; returns
    the output tokens and each step's (first position, number of tokens)."""
    scheduler.add_request(request)
    tokens, steps, previous = iter(token_ids), [], None
    while request.status in (RequestStatus.WAITING, RequestStatus.RUNNING) or previous:
        out = scheduler.schedule()
        steps += [(s.num_computed_tokens, len(s.token_ids)) for s in out.scheduled]
        if previous is not None:
            scheduler.update_from_output(
                previous, {s.request_id: next(tokens) for s in previous.scheduled if s.samples})
        previous = out if out.scheduled else None
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.num_gpu_blocks - 1
    return list(request.output_token_ids), steps


@pytest.mark.parametrize("num_prompt, params, num_outputs", [
    (10, dict(max_tokens=1), 1),
    (10, dict(max_tokens=3), 3),
    (14, dict(max_tokens=None), 2),  # 14 + 2 = max_model_len
    (16, dict(max_tokens=8), 1),  # the prompt fills max_model_len
])
def test_async_length_limits_do_not_over_schedule(num_prompt, params, num_outputs):
    scheduler = make_scheduler(max_model_len=16)
    request = make_request("r", num_prompt, **params)
    output, steps = run_async_to_finish(scheduler, request, range(20, 40))
    assert output == list(range(20, 20 + num_outputs))
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # One prefill, then a decode per token but the last: exactly what a sync run computes.
    assert steps == [(0, num_prompt)] + [(num_prompt + i, 1) for i in range(num_outputs - 1)]


def test_async_stop_token_wastes_one_grant_and_keeps_exact_outputs():
    scheduler = make_scheduler(max_model_len=32)
    request = make_request("r", 5, max_tokens=10, stop_token_ids=[7])
    output, steps = run_async_to_finish(scheduler, request, [3, 4, 7, 9, 9])
    assert output == [3, 4, 7] and request.stop_reason == 7
    assert steps == [(0, 5), (5, 1), (6, 1), (7, 1)]  # (7, 1) decodes the stop token: void


def test_async_preempted_request_gets_its_token_then_recomputes_real_tokens():
    scheduler = make_scheduler(num_blocks=5)  # 4 usable blocks of 8 tokens
    a, b = make_request("a", 16, max_tokens=3), make_request("b", 9, max_tokens=3)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out1 = scheduler.schedule()
    assert grants(scheduler, out1) == [("a", 0, 16, [1, 2], True), ("b", 0, 9, [3, 4], True)]
    out2 = scheduler.schedule()  # a's placeholder needs a block: b, the newest, is preempted
    assert grants(scheduler, out2) == [("a", 16, 1, [1, 2, 4], True)]
    assert out2.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # the pool is free again
    # b's token is still in flight: it is not recomputed before it is known.
    assert scheduler.schedule().scheduled == []
    assert scheduler.update_from_output(out1, {"a": 11, "b": 12}) == [b]
    assert list(b.output_token_ids) == [12] and b.num_output_placeholders == 0
    assert scheduler.update_from_output(out2, {"a": 13}) == []  # a was aborted
    out3 = scheduler.schedule()
    # free queue: [3] + a's [4, 2, 1]
    assert grants(scheduler, out3) == [("b", 0, 10, [3, 4], True)]
    assert out3.scheduled[0].token_ids == list(b.prompt_token_ids) + [12]
    assert out3.scheduled[0].num_output_tokens == 1


def test_async_preempted_request_that_stops_leaves_the_waiting_queue():
    scheduler = make_scheduler(num_blocks=5)
    a = make_request("a", 16, max_tokens=3)
    b = make_request("b", 9, max_tokens=3, all_stop_token_ids={2})
    scheduler.add_request(a)
    scheduler.add_request(b)
    out1 = scheduler.schedule()
    scheduler.schedule()  # preempts b
    assert scheduler.update_from_output(out1, {"a": 11, "b": 2}) == [a, b]
    assert b.status == RequestStatus.FINISHED_STOPPED and scheduler.num_waiting == 0
    assert scheduler.kv_cache_manager.get_block_ids("b") == [] and "b" not in scheduler.requests


def test_a_reused_request_id_does_not_get_the_finished_request_token():
    scheduler = make_scheduler()
    old = make_request("x", 4, max_tokens=1)
    scheduler.add_request(old)
    out1 = scheduler.schedule()
    scheduler.update_from_output(out1, {"x": 5})  # finished by max_tokens
    new = make_request("x", 4, max_tokens=5)
    scheduler.add_request(new)
    out2 = scheduler.schedule()
    assert scheduler.update_from_output(out1, {"x": 6}) == []  # a late (repeated) result
    assert list(new.output_token_ids) == [] and new.num_output_placeholders == 1
    assert scheduler.update_from_output(out2, {"x": 7}) == [new]
    assert list(new.output_token_ids) == [7]


def test_an_aborted_id_used_again_waits_for_the_steps_in_flight_that_hold_it():
    """The runner keys its requests by id: a new request under an id that steps in flight
    still hold (the aborted request's) is admitted only once their results are in, so the
    runner never records those results as the new request's tokens."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("x", 4, max_tokens=5))
    out1 = scheduler.schedule()
    out2 = scheduler.schedule()
    scheduler.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    new = make_request("x", 6, max_tokens=5)
    scheduler.add_request(new)
    scheduler.add_request(make_request("y", 3, max_tokens=5))
    assert scheduler.schedule().scheduled == []  # FCFS: y waits behind x
    assert scheduler.update_from_output(out1, {"x": 5}) == []
    assert scheduler.schedule().scheduled == []  # out2 still holds x
    assert scheduler.update_from_output(out2, {"x": 6}) == []
    out5 = scheduler.schedule()
    assert grants(scheduler, out5) == [("x", 0, 6, [2], True), ("y", 0, 3, [3], True)]
    assert out5.scheduled[0].token_ids == list(new.prompt_token_ids)
    assert scheduler.update_from_output(out5, {"x": 7, "y": 8}) == [new, scheduler.requests["y"]]
    assert list(new.output_token_ids) == [7]


def test_dp_ranks_send_an_id_in_flight_to_the_rank_that_holds_it():
    from jaxllm.core.dp_scheduler import DPScheduler

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    dp = DPScheduler([Scheduler(config, CacheConfig(block_size=8), 64) for _ in range(2)])
    dp.add_request(make_request("busy", 4, max_tokens=5))
    dp.add_request(make_request("x", 4, max_tokens=5))
    assert (dp.rank_of("busy"), dp.rank_of("x")) == (0, 1)
    out1 = dp.schedule()
    dp.finish_requests(["busy", "x"], RequestStatus.FINISHED_ABORTED)
    dp.add_request(make_request("x", 4, max_tokens=5))  # by load alone: rank 0
    dp.add_request(make_request("busy", 4, max_tokens=5))
    assert (dp.rank_of("busy"), dp.rank_of("x")) == (0, 1)
    dp.update_from_output(out1, {"busy": 1, "x": 2})
    assert [out.req_ids for out in dp.schedule().ranks] == [["busy"], ["x"]]


@pytest.mark.parametrize("async_order", [False, True])
def test_randomised_run_with_aborts_ends_with_every_block_free(async_order):
    rng = random.Random(1234)
    block_size, num_blocks, max_model_len = 8, 20, 48
    scheduler = make_scheduler(num_blocks, block_size, max_num_seqs=6, max_num_batched_tokens=24,
                               max_model_len=max_model_len)
    pool = scheduler.kv_cache_manager.block_pool
    expected_tokens = {}  # request id -> prompt + every token fed to it, kept by the test
    next_position = {}  # request id -> where its next grant must start
    in_flight = {}  # request id -> sampling grants whose tokens are not in yet
    runner_tables = {}  # request id -> block table kept from new_block_ids, as a runner would
    requests = []
    for i in range(120):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
        max_tokens = rng.choice([None, 1, 5, 20])
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[3], all_stop_token_ids={4},
                                min_tokens=0 if max_tokens == 1 else rng.choice([0, 2]))
        if i == 0 or rng.random() < 0.5:  # else a sibling of the previous one (n > 1)
            parent_id = f"p{i}"
        requests.append(Request(f"r{i}", prompt, params, parent_request_id=parent_id))
    pending = list(requests)
    num_steps = 0
    previous = None  # async order: the scheduled step whose update is still to come
    num_placeholders_granted = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if pending:
                request = pending.pop(0)
                scheduler.add_request(request)
                expected_tokens[request.request_id] = list(request.prompt_token_ids)
                next_position[request.request_id] = 0
                in_flight[request.request_id] = 0
        waiting_before = {r.request_id for r in scheduler.waiting}
        assert len(waiting_before) == len(scheduler.waiting) == sum(
            r.status != RequestStatus.RUNNING for r in scheduler.requests.values())
        out = scheduler.schedule()
        num_steps += 1
        if out.preempted_req_ids:  # as vLLM, a step that preempts admits no one
            assert not waiting_before & {s.request_id for s in out.scheduled}
        assert out.total_num_scheduled_tokens == sum(len(s.token_ids) for s in out.scheduled) <= 24
        assert len(out.scheduled) <= 6 and scheduler.num_running <= 6
        for request_id in out.preempted_req_ids:
            next_position[request_id] = 0
        held_blocks = []
        for s in out.scheduled:
            tokens = expected_tokens[s.request_id] + [PH] * in_flight[s.request_id]
            start = next_position[s.request_id]
            end = start + len(s.token_ids)
            assert s.num_computed_tokens == start
            assert s.token_ids == tokens[start:end]
            assert s.token_ids.count(PH) <= (start > 0)  # recompute reads only real tokens
            num_placeholders_granted += s.token_ids.count(PH)
            assert s.samples == (end == len(tokens))
            in_flight[s.request_id] += s.samples
            block_ids = scheduler.kv_cache_manager.get_block_ids(s.request_id)
            assert len(block_ids) == -(-end // block_size)
            # No grant beyond what the request's length limits allow (as in _check_fits).
            max_tokens = s.sampling_params.max_tokens or max_model_len
            assert end <= max(s.num_prompt_tokens,
                              min(max_model_len, s.num_prompt_tokens + max_tokens) - 1)
            next_position[s.request_id] = end
            if s.is_new:
                runner_tables[s.request_id] = []
            runner_tables[s.request_id] += s.new_block_ids
            assert runner_tables[s.request_id] == block_ids
            held_blocks += block_ids
        held_blocks += [b for r in scheduler.running for b in
                        scheduler.kv_cache_manager.get_block_ids(r.request_id)
                        if r.request_id not in {s.request_id for s in out.scheduled}]
        assert 0 not in held_blocks and len(set(held_blocks)) == len(held_blocks)
        assert pool.num_free_blocks + len(held_blocks) == num_blocks - 1
        assert all(pool.blocks[b].ref_cnt == 1 for b in held_blocks)
        if rng.random() < 0.15 and scheduler.requests:  # abort a waiting or running request
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if async_order:
            out, previous = previous, out
        if out is None:
            continue
        sampled = {s.request_id: rng.randrange(1, 60) for s in out.scheduled}
        updated = scheduler.update_from_output(out, sampled)
        for request in updated:
            expected_tokens[request.request_id].append(sampled[request.request_id])
            in_flight[request.request_id] -= 1
            assert list(request.all_token_ids) == expected_tokens[request.request_id]
            assert request.num_tokens <= max_model_len
            assert request.num_output_tokens <= (request.sampling_params.max_tokens or 99)
    assert all(r.is_finished() for r in requests)
    assert {r.get_finished_reason() for r in requests} == {"stop", "length", "abort"}
    assert scheduler.num_preemptions_total > 0 and num_steps < 2000
    assert (num_placeholders_granted > 0) == async_order
    assert pool.num_free_blocks == num_blocks - 1
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert scheduler.kv_cache_manager.req_to_blocks == {}


def test_a_continuing_request_crosses_to_the_runner_as_a_delta():
    """Everything once in NewRequestData; after that only new block ids and the position, never
    the token list or the whole block table again, and the runner still computes every
    token."""
    from dataclasses import fields

    from jaxllm.core.scheduler import CachedRequestData
    assert {f.name for f in fields(CachedRequestData)} == {
        "request_id", "new_block_ids", "num_computed_tokens"}
    scheduler = make_scheduler(block_size=8, max_num_seqs=2, max_num_batched_tokens=12)
    a = make_request("a", 20, max_tokens=6)
    scheduler.add_request(a)
    step = scheduler.schedule()
    assert [r.request_id for r in step.scheduled_new_reqs] == ["a"]
    assert step.scheduled_new_reqs[0].prompt_token_ids == a.prompt_token_ids
    assert step.scheduled_new_reqs[0].block_ids == [1, 2]  # a 12-token chunk of the prompt
    seen_blocks = [1, 2]
    for i in range(8):
        sample_all(scheduler, step, token_id=20 + i)
        if a.is_finished():
            break
        step = scheduler.schedule()
        assert step.scheduled_new_reqs == []
        (cached,) = step.scheduled_cached_reqs
        assert cached.num_computed_tokens == step.scheduled[0].num_computed_tokens
        assert len(cached.new_block_ids) <= 1  # at most the block a decode opens
        seen_blocks += cached.new_block_ids
        assert seen_blocks == scheduler.kv_cache_manager.get_block_ids("a")
        expected = (a.prompt_token_ids + a.output_token_ids)[cached.num_computed_tokens:].tolist()
        assert step.scheduled[0].token_ids == expected
    assert list(a.output_token_ids) == [21, 22, 23, 24, 25, 26]  # step 1 was a partial prefill
