"""Per-request block tables on top of the block pool, and automatic prefix caching.

With prefix caching every full block of known tokens is named by a chained hash
(kv_cache_utils.py) once a step is granted to compute it; a request being admitted reuses the
longest run of named blocks that starts its tokens (ref_cnt + 1) and computes only the rest,
always at least its last token so that the step has its logits. The block is named when the
grant is made, not when the step ends: a request admitted in the same step may then read it,
which is exact because every layer writes the step's KV before its attention reads the cache.
With caching off only the n > 1 children of one request share (their `share_group` key, which no
other request carries); other requests are never hashed.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxllm.core.block_pool import BlockPool, KVCacheBlock
from jaxllm.core.kv_cache_utils import (block_extra_keys, get_hash_fn, hash_block_tokens,
                                        init_none_hash)
from jaxllm.core.request import Request


@dataclass
class PrefixCacheStats:
    """vLLM's prefix cache counters, in tokens, over first admissions (not resumptions)."""
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256") -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as plain ids, kept in step so a step's block tables cost no conversion.
        self.req_to_block_ids: dict[str, list[int]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: its leading named blocks
        self.hash_fn = get_hash_fn(hash_algo)
        self.none_hash = init_none_hash(self.hash_fn)
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def _caches(self, request: Request) -> bool:
        return self.enable_caching or request.share_group is not None

    # ---- prefix caching ----

    def block_hashes(self, request: Request) -> list[bytes]:
        """The request's block hashes, extended over its full blocks of known tokens."""
        hashes, size = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            parent = hashes[-1] if hashes else self.none_hash
            extra = block_extra_keys(request.cache_salt, request.share_group, request.lora_key,
                                     start // size)
            hashes.append(hash_block_tokens(self.hash_fn, parent, tokens[start:start + size],
                                            extra))
        return hashes

    def share_hash_seed(self, other: KVCacheManager) -> None:
        """Names blocks with `other`'s first parent hash from now on, so that one prompt's hashes
        hold in both (the DP replicas of one engine: their router hashes a prompt once).
        Only before any block is named, or the blocks named so far would never hit."""
        if self.block_pool.cached_block_hash_to_block:
            raise RuntimeError("share_hash_seed after blocks were named")
        self.hash_fn, self.none_hash = other.hash_fn, other.none_hash

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks that starts the request's tokens, short of its last
        token, and how many tokens they hold. A request that asks for prompt logprobs needs
        every prompt position's logits, so it reads nothing (as vLLM). Read only: neither ref
        counts nor the free queue's order change until allocate_slots takes the blocks, so
        the DP router may probe every replica with it."""
        if not self._caches(request) or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        """Counts a first admission's lookup (vLLM's prefix_cache_queries and _hits)."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_cached_tokens

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- block tables ----

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] = ()) -> list[int] | None:
        """Makes room for `num_new_tokens` tokens after the request's computed ones and the
        cached blocks a new admission reuses (`new_computed_blocks`, which follow its
        num_computed_tokens). Returns the ids of the blocks added to its table (often none),
        or None, allocating nothing, when the pool has too few free blocks."""
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        table = self.req_to_blocks.get(request.request_id)
        if table and not new_computed_blocks and -(-num_tokens // self.block_size) <= len(table):
            # Most decode grants: no new block, and one to name only when a block fills (in sync
            # mode) or its last token became known (in async mode: one step later).
            if (num_tokens % self.block_size <= 1 or num_new_tokens > 1) and self._caches(request):
                self._cache_blocks(request, num_tokens)
            return []
        table = self.req_to_blocks.setdefault(request.request_id, [])
        block_ids = self.req_to_block_ids.setdefault(request.request_id, [])
        num_needed = max(-(-num_tokens // self.block_size) - len(table)
                         - len(new_computed_blocks), 0)
        # Reused blocks that are free leave the free queue.
        num_reused_free = sum(block.ref_cnt == 0 for block in new_computed_blocks)
        if num_needed > self.block_pool.num_free_blocks - num_reused_free:
            if not table:
                self._forget(request)
            return None
        self.block_pool.touch(new_computed_blocks)
        added = list(new_computed_blocks) + self.block_pool.get_new_blocks(num_needed)
        table.extend(added)
        new_ids = [block.block_id for block in added]
        block_ids.extend(new_ids)
        if self._caches(request):
            self._cache_blocks(request, num_tokens)
        return new_ids

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Names the request's blocks that are full of known tokens once `num_tokens` are
        computed (tokens still being sampled are named by a later grant)."""
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[request.request_id][num_cached:num_full],
                self.block_hashes(request)[num_cached:num_full])
            self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first: the tail is the least likely to be a shared
        prefix, so it is evicted first (as vLLM)."""
        blocks = self.req_to_blocks.get(request.request_id)
        self._forget(request)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def _forget(self, request: Request) -> None:
        self.req_to_blocks.pop(request.request_id, None)
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: copy it to keep it)."""
        return self.req_to_block_ids.get(request_id, [])
