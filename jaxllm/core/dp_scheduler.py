"""DP attention's scheduler: one Scheduler per data-parallel rank behind the interface EngineCore
drives, so that one engine steps every rank in one program (vLLM's DP attention for MoE).

Each rank keeps its own requests and its own block pool, so block ids are local to the rank's
slice of the KV cache. A new request goes where its prompt's prefix is cached, within a load
bound (prefix_aware_rank, shared with the DP replicas' router in engine/dp_engine.py); n > 1
children arrive one by one and are routed one by one, as vLLM's DP client routes each child
request. Ranks with nothing to do still step, on a padding batch (the
runner pads every rank to one bucket), because the MoE layers' collectives span all ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from jaxllm.core.kv_cache_manager import KVCacheManager
from jaxllm.core.request import Request, RequestStatus
from jaxllm.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats


@dataclass(slots=True)
class DPSchedulerOutput:
    ranks: list[SchedulerOutput]  # one per DP rank

    @property
    def num_reqs(self) -> int:
        return sum(out.num_reqs for out in self.ranks)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(out.total_num_scheduled_tokens for out in self.ranks)

    @property
    def finished_req_ids(self) -> set[str]:
        return set().union(*(out.finished_req_ids for out in self.ranks))

    @property
    def preempted_req_ids(self) -> set[str]:
        return set().union(*(out.preempted_req_ids for out in self.ranks))


def load_slack(max_num_seqs: int) -> int:
    """How much busier than the least loaded rank a rank holding a request's prefix may be."""
    return max(4, max_num_seqs // 4)


def prefix_aware_rank(loads: list[int], kv_managers: list[KVCacheManager], probe: Request,
                      slack: int) -> int:
    """The rank for a new request: the one holding the longest cached prefix of its prompt among
    those whose load is within `slack` of the least loaded; ties go to the less loaded, then the
    lower rank. A prefix hit saves its prefill, but a rank much busier than the others would
    delay the request more than recomputing saves. The ranks share one hash seed, so the
    probe's block hashes, computed by the first lookup, hold for every rank (lookups are read
    only)."""
    bound = min(loads) + slack
    eligible = [rank for rank, load in enumerate(loads) if load <= bound]
    if len(eligible) == 1:
        return eligible[0]
    cached = {rank: kv_managers[rank].get_computed_blocks(probe)[1] for rank in eligible}
    return min(eligible, key=lambda rank: (-cached[rank], loads[rank], rank))


class DPScheduler:
    def __init__(self, ranks: list[Scheduler]) -> None:
        self.ranks = ranks
        self._kv_managers = [rank.kv_cache_manager for rank in ranks]
        for kv in self._kv_managers[1:]:
            kv.share_hash_seed(self._kv_managers[0])
        self._load_slack = load_slack(ranks[0].max_num_seqs)

    def rank_loads(self) -> list[int]:
        """Unfinished requests per rank."""
        return [rank.get_num_unfinished_requests() for rank in self.ranks]

    def rank_of(self, request_id: str) -> int | None:
        return next((i for i, rank in enumerate(self.ranks) if request_id in rank.requests), None)

    def add_request(self, request: Request) -> None:
        if self.rank_of(request.request_id) is not None:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        # an id a rank's steps in flight still hold goes to that rank, which waits for them
        rank = next((i for i, rank in enumerate(self.ranks)
                     if rank.finished_id_in_flight(request.request_id)), None)
        if rank is None:
            rank = prefix_aware_rank(self.rank_loads(), self._kv_managers, request,
                                     self._load_slack)
        self.ranks[rank].add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finishes the requests on whichever rank holds them (others ignore unknown ids)."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rank in self.ranks:
            rank.finish_requests(request_ids, finished_status)

    def schedule(self) -> DPSchedulerOutput:
        return DPSchedulerOutput([rank.schedule() for rank in self.ranks])

    def update_from_output(self, scheduler_output: DPSchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        return [request for rank, out in zip(self.ranks, scheduler_output.ranks, strict=True)
                for request in rank.update_from_output(out, sampled_token_ids)]

    def has_unfinished_requests(self) -> bool:
        return any(rank.has_unfinished_requests() for rank in self.ranks)

    def get_num_unfinished_requests(self) -> int:
        return sum(self.rank_loads())

    @property
    def num_running(self) -> int:
        return sum(rank.num_running for rank in self.ranks)

    def make_stats(self) -> SchedulerStats:
        """Counts summed over the ranks; kv_cache_usage is their mean (pools are equal)."""
        stats = [rank.make_stats() for rank in self.ranks]
        return SchedulerStats(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                              sum(s.kv_cache_usage for s in stats) / len(stats),
                              sum(s.num_preemptions_total for s in stats),
                              sum(s.prefix_cache_queries_total for s in stats),
                              sum(s.prefix_cache_hits_total for s in stats))
