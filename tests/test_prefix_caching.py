"""Automatic prefix caching: block hashes, lookup and LRU eviction with exact block ids, salts,
the pool's invariants after every step of a randomised scheduler run, and the engine on the tiny
Llama: greedy (and penalised, seeded) outputs with caching on equal caching off over a stream of
shared system prompts, multi-turn histories, block-boundary prompts, preemption, chunking,
aborts, n > 1, sync and async; prompt logprobs on a hit equal a miss."""

from __future__ import annotations

import random
import sys

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import CacheConfig, SchedulerConfig
from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.kv_cache_utils import get_hash_fn
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler

BS = 4  # block size of the manager-level tests


def make_request(request_id, token_ids, salt=None, group=None, **params):
    return Request(request_id, list(token_ids), SamplingParams(**params), cache_salt=salt,
                   share_group=group)


def admit(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does on admission: the cached prefix, then blocks for the rest."""
    blocks, num_cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return list(manager.get_block_ids(request.request_id))


def check_pool(pool, holders: list[list[int]]) -> None:
    """Every block but 0 is referenced or in the free queue, never both; ref counts equal the
    number of tables holding the block; every cached hash names the block that holds it."""
    free = pool.free_block_queue.block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    counts = {}
    for table in holders:
        for block_id in table:
            counts[block_id] = counts.get(block_id, 0) + 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == counts.get(block.block_id, 0), block
        assert (block.ref_cnt == 0) == (block.block_id in free), block
    assert 0 not in counts and 0 not in free
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


# -- hashes --------------------------------------------------------------------------------------
def test_hashes_chain_over_tokens_and_salt_and_are_seeded_per_engine(monkeypatch):
    manager = KVCacheManager(16, BS)
    a = manager.block_hashes(make_request("a", range(10)))
    assert len(a) == 2  # full blocks only
    assert manager.block_hashes(make_request("b", range(8))) == a
    changed_first = manager.block_hashes(make_request("c", [99] + list(range(1, 8))))
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # the chain carries it
    salted = manager.block_hashes(make_request("d", range(8), salt="tenant"))
    assert salted[0] != a[0] and salted[1] != a[1]
    assert KVCacheManager(16, BS).block_hashes(make_request("a", range(8))) != a  # random seed
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    seeded = [KVCacheManager(16, BS).block_hashes(make_request("a", range(8))) for _ in "xy"]
    assert seeded[0] == seeded[1]
    xx = KVCacheManager(16, BS, hash_algo="xxhash").block_hashes(make_request("a", range(8)))
    assert len(xx[0]) == 16 and len(seeded[0][0]) == 32


def test_xxhash_without_the_package_and_unknown_algos_are_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ValueError, match="xxhash package"):
        get_hash_fn("xxhash")
    with pytest.raises(ValueError, match="must be 'sha256' or 'xxhash'"):
        CacheConfig(prefix_caching_hash_algo="md5")
    with pytest.raises(ValueError, match="xxhash package"):
        LLM("unused", prefix_caching_hash_algo="xxhash")


# -- lookup and eviction, exact block ids ----------------------------------------------------------
def test_lookup_reuse_and_lru_eviction_with_exact_block_ids():
    manager = KVCacheManager(8, BS)
    pool = manager.block_pool
    a = make_request("a", range(12))  # three full blocks: 1, 2, 3
    assert admit(manager, a) == [1, 2, 3]
    b = make_request("b", list(range(8)) + [50, 51, 52])  # shares a's first two blocks
    assert manager.get_computed_blocks(b)[1] == 8
    assert admit(manager, b) == [1, 2, 4]
    check_pool(pool, [[1, 2, 3], [1, 2, 4]])
    manager.free(a)  # tail first: 3 joins the queue; 1 and 2 are still b's
    manager.free(b)
    # LRU: the never-used 5, 6, 7 first, then a's tail, then b's blocks tail first.
    assert pool.free_block_queue.block_ids() == [5, 6, 7, 3, 4, 2, 1]
    check_pool(pool, [])
    c = make_request("c", list(range(8)) + [60])  # hits the freed 1, 2 out of the queue
    assert admit(manager, c) == [1, 2, 5]
    assert pool.free_block_queue.block_ids() == [6, 7, 3, 4]
    third_block = manager.block_hashes(a)[2]
    assert pool.get_cached_block(third_block) is pool.blocks[3]
    d = make_request("d", range(100, 116))  # four new blocks: 6, 7, then 3 and 4 are reused
    assert admit(manager, d) == [6, 7, 3, 4]
    assert pool.get_cached_block(third_block) is None  # reusing 3 evicted a's third block
    named = sorted(block.block_id for block in pool.cached_block_hash_to_block.values())
    assert named == [1, 2, 3, 4, 6, 7]  # a's first two, then d's four
    assert manager.get_computed_blocks(make_request("e", range(13)))[1] == 8
    check_pool(pool, [[1, 2, 5], [6, 7, 3, 4]])
    manager.free(c)
    manager.free(d)
    assert pool.free_block_queue.block_ids() == [5, 2, 1, 4, 3, 7, 6]
    assert manager.reset_prefix_cache() and pool.cached_block_hash_to_block == {}


def test_the_last_token_is_always_computed_on_a_block_boundary():
    manager = KVCacheManager(16, BS)
    admit(manager, make_request("a", range(12)))
    again = make_request("b", range(12))  # all three blocks cached: the last is recomputed
    blocks, num_cached = manager.get_computed_blocks(again)
    assert num_cached == 8 and len(blocks) == 2
    longer = make_request("c", range(13))
    assert manager.get_computed_blocks(longer)[1] == 12


def test_different_salts_never_share_a_block():
    manager = KVCacheManager(32, BS)
    tables = {salt: admit(manager, make_request(f"r{salt}", range(17), salt=salt))
              for salt in (None, "x", "y")}
    assert not set(tables[None]) & set(tables["x"])
    assert not set(tables["x"]) & set(tables["y"]) and not set(tables[None]) & set(tables["y"])
    assert admit(manager, make_request("again", range(17), salt="x"))[:4] == tables["x"][:4]


def test_prompt_logprobs_read_nothing_but_are_cached_and_stats_count_tokens():
    manager = KVCacheManager(32, BS)
    admit(manager, make_request("a", range(9)))
    assert (manager.stats.queries, manager.stats.hits) == (0, 0)  # the scheduler records
    wants = make_request("b", range(9), prompt_logprobs=1)
    assert manager.get_computed_blocks(wants) == ([], 0)
    manager.record_admission(make_request("c", range(9)), 8)
    manager.record_admission(wants, 0)  # a request that reads nothing is not a query
    assert (manager.stats.queries, manager.stats.hits) == (9, 8)


def test_caching_off_shares_only_within_an_n_group():
    manager = KVCacheManager(32, BS, enable_caching=False)
    first = admit(manager, make_request("a", range(9)))
    assert manager.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert not manager.block_pool.cached_block_hash_to_block  # nothing is even hashed
    child0 = admit(manager, make_request("p#0", range(9), group=0))
    assert admit(manager, make_request("p#1", range(9), group=0))[:2] == child0[:2]
    assert manager.get_computed_blocks(make_request("q#0", range(9), group=1)) == ([], 0)
    assert not set(first) & set(child0)


def test_reset_prefix_cache_only_when_no_block_is_held():
    manager = KVCacheManager(16, BS)
    a = make_request("a", range(9))
    admit(manager, a)
    assert not manager.reset_prefix_cache()
    assert manager.block_pool.cached_block_hash_to_block  # unchanged
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert all(block.block_hash is None for block in manager.block_pool.blocks)


def test_a_lookup_is_read_only_and_replicas_can_share_the_hash_seed():
    """What the DP router relies on: probing a replica's cache changes neither ref counts nor the
    LRU order, and replicas given one seed find each other's prompts by the same hashes."""
    manager, other = KVCacheManager(16, BS), KVCacheManager(16, BS)
    kept, freed = make_request("kept", range(9)), make_request("freed", range(20, 33))
    admit(manager, kept)
    admit(manager, freed)
    manager.free(freed)
    pool = manager.block_pool
    before = (pool.free_block_queue.block_ids(), [block.ref_cnt for block in pool.blocks])
    assert manager.get_computed_blocks(make_request("p", range(9)))[1] == 8
    assert manager.get_computed_blocks(make_request("q", range(20, 33)))[1] == 12  # free blocks
    assert (pool.free_block_queue.block_ids(), [block.ref_cnt for block in pool.blocks]) == before
    probe = make_request("r", range(9))
    assert other.get_computed_blocks(probe) == ([], 0)  # its own random seed
    other.share_hash_seed(manager)
    assert other.block_hashes(make_request("s", range(9))) == manager.block_hashes(kept)
    with pytest.raises(RuntimeError, match="after blocks were named"):
        manager.share_hash_seed(other)


# -- the scheduler: a randomised run, invariants after every step ------------------------------
@pytest.mark.parametrize("async_order", [False, True])
def test_randomised_scheduler_run_keeps_the_pool_invariants(async_order):
    rng = random.Random(7)
    scheduler = Scheduler(SchedulerConfig(6, 24, 64), CacheConfig(block_size=8), 16)
    kv = scheduler.kv_cache_manager
    systems = [[rng.randrange(1, 50) for _ in range(n)] for n in (8, 16, 20)]
    pending = []
    for i in range(100):
        prompt = rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 12))]
        params = dict(max_tokens=rng.choice([1, 4, 12]), stop_token_ids=[3],
                      prompt_logprobs=rng.choice([None] * 9 + [1]))
        pending.append(make_request(f"r{i}", prompt or [1], salt=rng.choice([None, None, "s"]),
                                    **params))
    requests, previous, hits = list(pending), None, 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        out = scheduler.schedule()
        for new in out.scheduled_new_reqs:
            hits += new.num_computed_tokens > 0
            assert new.num_computed_tokens % 8 == 0
            assert new.num_computed_tokens < len(new.prompt_token_ids) + len(new.output_token_ids)
            assert new.block_ids == kv.get_block_ids(new.request_id)
        check_pool(kv.block_pool, [kv.get_block_ids(r) for r in kv.req_to_blocks])
        if rng.random() < 0.1 and scheduler.requests:
            scheduler.finish_requests(rng.choice(sorted(scheduler.requests)),
                                      RequestStatus.FINISHED_ABORTED)
        if async_order:
            out, previous = previous, out
        if out is not None:
            scheduler.update_from_output(out, {r: [rng.randrange(1, 50)]
                                               for r in out.num_scheduled_tokens})
        check_pool(kv.block_pool, [kv.get_block_ids(r) for r in kv.req_to_blocks])
    assert hits > 20 and scheduler.num_preemptions_total > 0
    assert all(r.is_finished() for r in requests)
    assert kv.block_pool.num_free_blocks == 15 and kv.req_to_blocks == {}
    stats = scheduler.make_stats()
    assert 0 < stats.prefix_cache_hits_total < stats.prefix_cache_queries_total


# -- the engine, on and off --------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_llama_dir) -> dict[bool, LLM]:
    """enable_prefix_caching -> an engine with a small pool (preemption) and a small token
    budget (chunking); async scheduling is switched per run."""
    return {caching: LLM(tiny_llama_dir, max_model_len=96, max_num_seqs=6,
                         max_num_batched_tokens=16, num_gpu_blocks_override=16, block_size=8,
                         compilation_cache_dir=None, enforce_eager=True,
                         enable_prefix_caching=caching)
            for caching in (False, True)}


def stream_plan(seed: int, num_requests: int = 30):
    """[(add step, id, prompt, params)] and {id: abort step}: shared system prompts, a prompt of
    exactly three blocks, fresh prompts, n = 2. Fixed in advance, so both engines see the same
    stream whatever their timing."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 300) for _ in range(n)] for n in (16, 21)]
    plan, step = [], 0
    for i in range(num_requests):
        step += rng.randrange(3)
        kind = rng.choice(["system", "system", "boundary", "fresh"])
        if kind == "boundary":
            prompt = systems[0] + systems[0][:8]
        else:
            prompt = ((rng.choice(systems) if kind == "system" else [])
                      + [rng.randrange(3, 300) for _ in range(rng.randint(1, 12))])
        plan.append((step, str(i), prompt, SamplingParams(
            temperature=0.0, max_tokens=rng.randint(2, 12), n=rng.choice([1, 1, 2]),
            ignore_eos=True)))
    aborts = {rid: add + rng.randrange(1, 10)
              for add, rid, _, _ in rng.sample(plan, num_requests // 6)}
    return plan, aborts


def drive(engine, plan, aborts) -> dict:
    """Steps the engine through the plan, checking the pool's invariants after every step;
    returns each finished request's outputs."""
    kv = engine.scheduler.kv_cache_manager
    pending, finished, step = list(plan), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, prompt, params)
        engine.abort_request([rid for rid, when in aborts.items() if when == step])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        check_pool(kv.block_pool, [kv.get_block_ids(r) for r in kv.req_to_blocks])
        step += 1
    assert kv.block_pool.num_free_blocks == engine.num_blocks - 1
    return finished


def run_stream(llm: LLM, seed: int, async_scheduling: bool) -> dict:
    """The plan, then a second turn of some finished conversations (each resends its prompt
    and output); the outputs of every request that was not marked for abort."""
    engine = llm.llm_engine
    engine.async_scheduling = async_scheduling
    plan, aborts = stream_plan(seed)
    first = drive(engine, plan, aborts)
    kept = sorted((r for r in first if r not in aborts), key=int)[:10]
    rng = random.Random(seed + 1)
    turns = [(i, f"{r}.2", first[r].prompt_token_ids + first[r].outputs[0].token_ids
              + [rng.randrange(3, 300) for _ in range(rng.randint(1, 6))],
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
             for i, r in enumerate(kept)]
    second = drive(engine, turns, {})
    outputs = {r: [c.token_ids for c in o.outputs] for r, o in {**first, **second}.items()
               if r not in aborts}
    assert all(outs[0] == outs[-1] for outs in outputs.values())  # greedy n = 2 samples agree
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_stream_with_caching_equals_without(engines, async_scheduling):
    on = engines[True].llm_engine
    hits_before = on.get_stats()["prefix_cache_hits_total"]
    results = {caching: run_stream(llm, 5, async_scheduling) for caching, llm in engines.items()}
    assert results[True] == results[False] and len(results[True]) > 30
    assert on.get_stats()["prefix_cache_hits_total"] - hits_before > 200
    assert on.get_stats()["num_preemptions_total"] > 0
    assert engines[False].llm_engine.get_stats()["prefix_cache_queries_total"] == 0


def test_penalties_and_seeds_are_exact_on_a_hit(engines):
    """A hit's cached prompt tokens reach the penalty row although no step computes them."""
    rng = random.Random(2)
    system = [rng.randrange(3, 300) for _ in range(8)] * 3  # repeated tokens: penalties bite
    prompts = [system + [rng.randrange(3, 300) for _ in range(k)] for k in (1, 5, 9, 3)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.8),
              SamplingParams(temperature=1.0, seed=4, max_tokens=10, presence_penalty=1.5,
                             frequency_penalty=0.8, n=2),
              SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=0.5,
                             frequency_penalty=-1.0),
              SamplingParams(temperature=0.7, seed=9, max_tokens=10, repetition_penalty=1.3)]
    got = {}
    for caching, llm in engines.items():
        llm.llm_engine.async_scheduling = True
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
        got[caching] = [[c.token_ids for c in o.outputs] for run in runs for o in run]
        if caching:
            assert [o.num_cached_tokens for o in runs[1]] == [24, 24, 32, 24]  # whole blocks
    assert got[True] == got[False]


def test_prompt_logprobs_on_a_hit_equal_a_miss(engines):
    llm = engines[True]
    prompt = list(range(10, 30))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    miss = llm.generate([prompt], params, use_tqdm=False)[0]
    llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # cached now
    hit = llm.generate([prompt], params, use_tqdm=False)[0]
    assert hit.prompt_logprobs == miss.prompt_logprobs and hit.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    plain = llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 16


def test_llm_reset_prefix_cache_and_cache_salt(engines):
    llm = engines[True]
    prompt = list(range(40, 60))
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    salted = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "tenant-a"}],
                          SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert salted.num_cached_tokens == 0
    assert llm.generate([prompt], SamplingParams(max_tokens=1),
                        use_tqdm=False)[0].num_cached_tokens == 16
    engine = llm.llm_engine
    engine.add_request("held", prompt, SamplingParams(max_tokens=3))
    engine.step()
    assert llm.reset_prefix_cache() is False
    engine.abort_request(["held"])
    assert llm.reset_prefix_cache() is True
    assert llm.generate([prompt], SamplingParams(max_tokens=1),
                        use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], use_tqdm=False)


def test_dp_attention_ranks_take_requests_where_their_prefix_is_cached():
    """DP attention's scheduler routes as the DP replicas' router: to the rank holding the
    prompt's prefix, unless that rank is beyond the load bound (max(4, max_num_seqs // 4))."""
    from jaxllm.core.dp_scheduler import DPScheduler

    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=128)
    ranks = [Scheduler(config, CacheConfig(block_size=8), 64) for _ in range(2)]
    dp = DPScheduler(ranks)
    prefix = list(range(100, 132))  # four full blocks
    dp.add_request(make_request("first", prefix + [7]))
    dp.schedule()  # admitted on rank 0: its full blocks are named
    assert dp.rank_of("first") == 0
    dp.add_request(make_request("other", list(range(200, 210))))  # by load: rank 1
    dp.add_request(make_request("shared", prefix + [8, 9]))  # loads [1, 1]: the prefix decides
    assert (dp.rank_of("other"), dp.rank_of("shared")) == (1, 0)
    for i in range(4):  # the prefix draws them to rank 0 while it is within the bound
        dp.add_request(make_request(f"more{i}", prefix + [20 + i]))
        assert dp.rank_of(f"more{i}") == 0
    assert dp.rank_loads() == [6, 1]  # 6 > 1 + 4: the next one goes to rank 1 after all
    dp.add_request(make_request("late", prefix + [30]))
    assert dp.rank_of("late") == 1
