"""The scheduler of pooling models: first-come first-served batches of whole prompts.

A pooling request is done after one forward over its prompt, and a pooling step keeps no KV
cache, so the generation scheduler's machinery (blocks, chunking, placeholders, preemption) has
nothing to do here. A step runs a padded batch of `S` rows of length `L`, both from the runner's
fixed grid (worker/pooling_runner.py: batch_shapes) so that every program is compiled at
warm-up: the scheduler takes waiting requests in arrival order while the longest prompt's
length bucket still has room for one more row. With LoRA, a step's adapters and those of the
step still in flight (whose device slots must stay) number at most max_loras: a request that
would add one more waits for a later step, and the requests behind it go.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from jaxllm.pooling_params import PoolingParams


@dataclass
class PoolingRequest:
    request_id: str
    prompt_token_ids: list[int]
    pooling_params: PoolingParams
    lora_request: object = None  # its LoRA adapter (jaxllm.lora.LoRARequest), or None
    lora_slot: int = 0  # the device slot of its adapter, set when its step is launched

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0


def bucket(value: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= value)


class PoolingScheduler:
    def __init__(self, max_model_len: int, shapes: dict[int, list[int]],
                 max_loras: int | None = None) -> None:
        """shapes: length bucket -> its row-count buckets, ascending (the largest is the most
        rows a step of that length takes); max_loras: LoRA enabled, its device slots."""
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.shapes = shapes
        self.lengths = sorted(shapes)
        self.waiting: OrderedDict[str, PoolingRequest] = OrderedDict()

    def add_request(self, request: PoolingRequest) -> None:
        if request.request_id in self.waiting:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        if not 0 < len(request.prompt_token_ids) <= self.max_model_len:
            raise ValueError(f"The prompt (length {len(request.prompt_token_ids)}) must have 1 "
                             f"to {self.max_model_len} tokens.")
        self.waiting[request.request_id] = request

    def abort(self, request_ids) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def schedule(self, held_loras: set[int] = frozenset()) -> list[PoolingRequest]:
        """The next batch, oldest first; each request leaves the queue (it finishes in the
        step that computes it). held_loras: the adapter ids of the step in flight."""
        batch, longest, most_rows = [], 0, 0
        loras = set(held_loras) - {0}
        for request in self.waiting.values():
            lora = request.lora_int_id
            if lora and lora not in loras and len(loras) >= (self.max_loras or 0):
                continue
            length = len(request.prompt_token_ids)
            rows = most_rows if length <= longest else self.shapes[bucket(length, self.lengths)][-1]
            if len(batch) >= rows:
                break
            batch.append(request)
            if lora:
                loras.add(lora)
            longest, most_rows = max(longest, length), rows
        for request in batch:
            del self.waiting[request.request_id]
        return batch
