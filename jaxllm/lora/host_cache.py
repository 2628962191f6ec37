"""HostLoRACache: adapters read from disk, kept in host memory, least recently used evicted
(vLLM's --max-cpu-loras). An optional `prepare` turns a loaded adapter into what is kept (the
device slots keep it packed in their layout, so that moving it in is a copy)."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Callable

from jaxllm.lora.peft import LoRAAdapter, load_peft_adapter
from jaxllm.lora.request import LoRARequest
from jaxllm.models.args import ModelArgs


class HostLoRACache:
    def __init__(self, args: ModelArgs, max_lora_rank: int, capacity: int,
                 prepare: Callable[[LoRAAdapter], object] | None = None):
        if capacity < 1:
            raise ValueError(f"max_cpu_loras must be at least 1, got {capacity}.")
        self.args, self.max_lora_rank, self.capacity = args, max_lora_rank, capacity
        self._prepare = prepare or (lambda adapter: adapter)
        self._adapters: OrderedDict[int, object] = OrderedDict()  # oldest use first
        # id -> (name, path) of every adapter loaded and not removed, evicted ones included: an
        # id stays bound to one adapter, so that nothing keyed by id (device slots) goes stale.
        self._identities: dict[int, tuple[str, str]] = {}
        self.load_seconds = 0.0  # the last load's wall time

    def get(self, request: LoRARequest):
        """The adapter of `request` (as `prepare` made it), loaded on a miss; marks it most
        recently used."""
        self._check_identity(request)
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is None:
            return self._load(request)
        self._adapters.move_to_end(request.lora_int_id)
        return adapter

    def add(self, request: LoRARequest):
        """Loads ahead of first use (vLLM's add_lora); the same as get."""
        return self.get(request)

    def remove(self, lora_int_id: int) -> bool:
        """Forgets the adapter and its id binding; False if it was not known."""
        known = self._identities.pop(lora_int_id, None) is not None
        return self._adapters.pop(lora_int_id, None) is not None or known

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def ids(self) -> list[int]:
        """The cached ids, least recently used first."""
        return list(self._adapters)

    def _check_identity(self, request: LoRARequest) -> None:
        bound = self._identities.get(request.lora_int_id)
        if bound is not None and bound != _identity(request):
            raise ValueError(
                f"LoRA id {request.lora_int_id} is already used by adapter {bound[0]!r} "
                f"({bound[1]}); it cannot also name {request.lora_name!r} "
                f"({request.lora_path}). Remove it first or use another lora_int_id.")

    def _load(self, request: LoRARequest):
        start = time.perf_counter()
        adapter = self._prepare(load_peft_adapter(
            request.lora_path, self.args, max_lora_rank=self.max_lora_rank, name=request.lora_name))
        self.load_seconds = time.perf_counter() - start
        self._identities[request.lora_int_id] = _identity(request)
        self._adapters[request.lora_int_id] = adapter
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)
        return adapter


def _identity(request: LoRARequest) -> tuple[str, str]:
    return request.lora_name, os.path.normpath(request.lora_path)
