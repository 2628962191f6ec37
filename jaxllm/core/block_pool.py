"""The pool of KV cache blocks: reference counts and a free queue with O(1) removal.

Block 0 is reserved: padding tokens write their K/V there, so it is never handed out.

The free queue is ordered for eviction (least recently used first): `get_new_blocks` takes
from the front, freed blocks are appended at the back. With prefix caching a free block may
still hold a cached prefix (it keeps its `block_hash`); a prefix hit then `touch`es it out of the
middle of the queue (hence the doubly-linked list) and an allocation that reuses it evicts its
hash. Sharing (prefix hits, the prompt blocks of n > 1 samples) is a `touch`: ref_cnt + 1.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Hash of the full block's tokens (and its prefix), set by prefix caching; None: uncached.
        self.block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """A doubly-linked list of free blocks between two sentinels: O(1) popleft, append, remove."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("No free blocks in the queue.")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"Block {block.block_id} is not in the free queue.")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """The free block ids, front (next to be handed out) first."""
        ids = []
        block = self._head.next_free_block
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free_block
        return ids


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved for padding), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # block_hash -> the block holding that full block's KV (filled by prefix caching).
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the reserved one) that are in use."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} blocks: only {self.num_free_blocks} are free.")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict_cached_block(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: Iterable[KVCacheBlock],
                          block_hashes: Iterable[bytes]) -> None:
        """Names full blocks by their hashes. A block whose hash another block already holds
        (the same prefix computed twice) stays unnamed: one block per hash."""
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; refused (False) while any block is held, as vLLM."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Shares blocks: ref_cnt + 1, taking a free (cached) block out of the free queue."""
        for block in blocks:
            if block.block_id == 0:
                raise ValueError("Block 0 is reserved for padding and cannot be shared.")
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; blocks reaching 0 join the back of the free queue
        in the given order (so the first of them is evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"Block {block.block_id} is freed more often than it is held.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
