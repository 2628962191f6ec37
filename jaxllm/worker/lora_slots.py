"""The adapters' device slots: which LoRA adapter each of the max_loras slots holds, moved in from
the host cache when a request needs one that is not on the device.

Slot 0 is the base model (zeros) and never changes. A slot is taken for a new adapter only when
no live request uses it: an empty one first, else the least recently used. The scheduler keeps
the running requests to at most max_loras adapters, so one is always free. Replacing a slot's
weights is one program (models.lora.write_slot) for every slot, so switching adapters never
compiles.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxllm.lora.host_cache import HostLoRACache
from jaxllm.lora.request import LoRARequest
from jaxllm.models import ModelArgs
from jaxllm.models.lora import init_stacks, pack_slot, write_slot


class LoRASlots:
    """host_cache keeps adapters packed as pack_slot's arrays in the stacks' dtype."""

    def __init__(self, host_cache: HostLoRACache, args: ModelArgs, max_loras: int,
                 max_lora_rank: int, dtype) -> None:
        self.host_cache = host_cache
        self.args = args
        self.rank, self.dtype = max_lora_rank, dtype
        self.stacks = init_stacks(args, max_loras + 1, max_lora_rank, dtype)  # on device
        self.slot_ids: dict[int, int] = {}  # lora_int_id -> its slot
        self.held: list[int | None] = [None] * (max_loras + 1)  # slot -> lora_int_id
        self._last_used = [0] * (max_loras + 1)  # slot -> tick of its last request
        self._tick = 0
        self.load_seconds = 0.0  # the last move into a slot (host to device, done)

    def with_stacks(self, params: dict) -> dict:
        """params carrying the current stacks in params["lora"] (moving an adapter in replaces
        them: the old arrays are donated)."""
        return params if params.get("lora") is self.stacks else {**params, "lora": self.stacks}

    def slot_for(self, lora_request: LoRARequest | None, busy: set[int]) -> int:
        """The slot holding the request's adapter, moved in if needed; busy: the slots live
        requests use, which must stay."""
        if lora_request is None:
            return 0
        self._tick += 1
        slot = self.slot_ids.get(lora_request.lora_int_id)
        if slot is None:
            slot = self._free_slot(busy)
            self._move_in(lora_request, slot)
        self._last_used[slot] = self._tick
        return slot

    def _free_slot(self, busy: set[int]) -> int:
        candidates = [s for s in range(1, len(self.held)) if s not in busy]
        if not candidates:
            raise RuntimeError(f"every LoRA slot is in use ({len(self.held) - 1}): the "
                               "scheduler admitted more adapters than max_loras")
        empty = [s for s in candidates if self.held[s] is None]
        return empty[0] if empty else min(candidates, key=self._last_used.__getitem__)

    def _move_in(self, lora_request: LoRARequest, slot: int) -> None:
        start = time.perf_counter()
        arrays = self.host_cache.get(lora_request)  # packed when loaded
        self.stacks = write_slot(self.stacks, np.int32(slot), arrays)
        jax.block_until_ready(self.stacks)
        self.load_seconds = time.perf_counter() - start
        old = self.held[slot]
        if old is not None:
            del self.slot_ids[old]
        self.held[slot] = lora_request.lora_int_id
        self.slot_ids[lora_request.lora_int_id] = slot

    def remove(self, lora_int_id: int) -> None:
        """Forgets an unloaded adapter's slot (its weights stay until the slot is reused, for
        requests that still run with it)."""
        slot = self.slot_ids.pop(lora_int_id, None)
        if slot is not None:
            self.held[slot] = None

    def warmup(self) -> None:
        """Compiles write_slot (zeros into slot 1, which holds nothing yet)."""
        zeros = pack_slot([{}] * self.args.num_layers, self.args, self.rank, self.dtype)
        self.stacks = write_slot(self.stacks, np.int32(1), zeros)
        jax.block_until_ready(self.stacks)


def make_lora_slots(lora_config, args: ModelArgs, dtype) -> LoRASlots | None:
    """With LoRA (a LoRAConfig, else None): the device slots, in `dtype`, over a host cache of
    adapters."""
    if lora_config is None:
        return None
    rank = lora_config.max_lora_rank
    host_cache = HostLoRACache(args, rank, lora_config.max_cpu_loras, prepare=lambda adapter: (
        pack_slot(adapter.layers, args, rank, dtype)))
    return LoRASlots(host_cache, args, lora_config.max_loras, lora_config.max_lora_rank, dtype)
