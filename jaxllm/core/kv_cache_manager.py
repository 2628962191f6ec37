"""Per-request block tables on top of the block pool."""

from __future__ import annotations

from jaxllm.core.block_pool import BlockPool, KVCacheBlock
from jaxllm.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as plain ids, kept in step so a step's block tables cost no conversion.
        self.req_to_block_ids: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Makes room for `num_new_tokens` tokens after the request's computed ones.

        Returns the ids of the blocks added to its table (often none), or None, allocating
        nothing, when the pool has too few free blocks.
        """
        num_tokens = request.num_computed_tokens + num_new_tokens
        block_ids = self.req_to_block_ids.get(request.request_id)
        num_held = 0 if block_ids is None else len(block_ids)
        num_needed = -(-num_tokens // self.block_size) - num_held
        if num_needed <= 0:
            return []
        if num_needed > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        new_ids = [block.block_id for block in new_blocks]
        if block_ids is None:
            self.req_to_blocks[request.request_id] = new_blocks
            self.req_to_block_ids[request.request_id] = list(new_ids)
        else:
            self.req_to_blocks[request.request_id].extend(new_blocks)
            block_ids.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first: the tail is the least likely to be a shared
        prefix, so with prefix caching it should be evicted first (as vLLM)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: copy it to keep it)."""
        return self.req_to_block_ids.get(request_id, [])
