"""DP attention's scheduler: one Scheduler per data-parallel rank behind the interface EngineCore
drives, so that one engine steps every rank in one program (vLLM's DP attention for MoE).

Each rank keeps its own requests and its own block pool, so block ids are local to the rank's
slice of the KV cache. A new request goes to the rank with the fewest unfinished requests (ties:
the lowest rank); n > 1 children arrive one by one and are routed one by one, as vLLM's DP
client routes each child request. Ranks with nothing to do still step, on a padding batch (the
runner pads every rank to one bucket), because the MoE layers' collectives span all ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


class DPScheduler:
    def __init__(self, ranks: list[Scheduler]) -> None:
        self.ranks = ranks

    def rank_loads(self) -> list[int]:
        """Unfinished requests per rank."""
        return [rank.get_num_unfinished_requests() for rank in self.ranks]

    def rank_of(self, request_id: str) -> int | None:
        return next((i for i, rank in enumerate(self.ranks) if request_id in rank.requests), None)

    def add_request(self, request: Request) -> None:
        if self.rank_of(request.request_id) is not None:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        loads = self.rank_loads()
        self.ranks[loads.index(min(loads))].add_request(request)

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
