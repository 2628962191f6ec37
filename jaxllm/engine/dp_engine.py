"""Data parallelism: DP engine replicas, each an EngineCore with its own KV pool and scheduler on
its own [1, TP] row of the mesh, behind one front end with EngineCore's interface. (MoE models
with expert parallelism instead get DP attention: see builder.make_engine and
core/dp_scheduler.py.)

A new request goes to the replica that holds the longest cached prefix of its prompt, among
those whose load (unfinished requests) is within max(4, max_num_seqs // 4) of the least loaded
(core/dp_scheduler.py: prefix_aware_rank, as DP attention's ranks): sending every request of a
popular prefix to one replica would leave the others idle. The replicas name blocks with one
hash seed (they are one engine; the seed keeps apart engines, not replicas). The children of a
request (n > 1) stay together, so prefix blocks and seeds behave as on one engine.

`step()` steps every busy replica in its own thread: each replica's jitted step runs on its own
devices and JAX releases the GIL while it waits for them, so the replicas' steps overlap.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from jaxllm.config import EngineConfig
from jaxllm.core.dp_scheduler import load_slack, prefix_aware_rank
from jaxllm.core.request import Request
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.sharding.mesh import make_mesh, replica_meshes

logger = logging.getLogger("jaxllm")


class DPEngine:
    def __init__(self, config: EngineConfig, build_engine_core: Callable,
                 log=logger.info) -> None:
        """build_engine_core(config, log, mesh) -> EngineCore builds each replica."""
        mesh = make_mesh(config.parallel_config)
        replica_config = dataclasses.replace(config, parallel_config=dataclasses.replace(
            config.parallel_config, data_parallel_size=1))
        self.replicas = []
        for rank, replica_mesh in enumerate(replica_meshes(mesh)):
            log(f"DP rank {rank}: devices {[d.id for d in replica_mesh.devices.flat]}")
            self.replicas.append(build_engine_core(replica_config, log, replica_mesh))
        first = self.replicas[0]
        self._kv_managers = [r.scheduler.kv_cache_manager for r in self.replicas]
        for kv in self._kv_managers[1:]:
            kv.share_hash_seed(self._kv_managers[0])
        self._load_slack = load_slack(config.scheduler_config.max_num_seqs)
        self.tokenizer, self.max_model_len = first.tokenizer, first.max_model_len
        self.model_name, self.eos_token_ids = first.model_name, first.eos_token_ids
        self.vocab_size, self.config = first.vocab_size, config
        self._replica_of: dict[str, int] = {}  # unfinished request id -> DP rank
        self._loads = [0] * len(self.replicas)  # unfinished requests per DP rank
        self._pool = ThreadPoolExecutor(max_workers=len(self.replicas))

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, prompt: str | None = None,
                    cache_salt: str | None = None, lora_request=None) -> None:
        if request_id in self._replica_of:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        # The replica checks again; the ids are checked first so that hashing never meets a
        # bad one.
        self.replicas[0].input_processor.process(prompt_token_ids)
        probe = Request(request_id, prompt_token_ids, sampling_params, cache_salt=cache_salt,
                        lora_request=lora_request)
        rank = prefix_aware_rank(self._loads, self._kv_managers, probe, self._load_slack)
        self.replicas[rank].add_request(request_id, prompt_token_ids, sampling_params, prompt,
                                        cache_salt, lora_request)
        self._replica_of[request_id] = rank
        self._loads[rank] += 1

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            rank = self._replica_of.pop(request_id, None)
            if rank is not None:
                self.replicas[rank].abort_request([request_id])
                self._loads[rank] -= 1

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        """Every replica's; False if a replica refused (its requests hold blocks)."""
        return all([r.reset_prefix_cache() for r in self.replicas])

    def step(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        outputs = [out for outs in self._pool.map(lambda r: r.step(), busy) for out in outs]
        for out in outputs:
            if out.finished and out.request_id in self._replica_of:
                self._loads[self._replica_of.pop(out.request_id)] -= 1
        return outputs

    def get_stats(self) -> dict:
        """Counts summed over the replicas; kv_cache_usage is their mean."""
        per_replica = [r.get_stats() for r in self.replicas]
        stats = {k: _sum([s[k] for s in per_replica]) for k in per_replica[0]}
        stats["kv_cache_usage"] = stats["kv_cache_usage"] / len(per_replica)
        stats["dp_num_unfinished"] = list(self._loads)
        return stats


def _sum(values: list):
    """A stat summed over replicas; list-valued ones (per draft position) element-wise."""
    if isinstance(values[0], list):
        return [sum(column) for column in zip(*values)]
    return sum(values)
