"""Prefix caching's block hashes: each full block is named by a hash of its parent block's hash,
its token ids and its extra keys, so one hash stands for the whole prefix up to the block's end.

A collision would silently serve another prefix's KV, hence a cryptographic default (sha256, as
vLLM); xxhash (xxh3-128) is faster and needs the `xxhash` package. The first block's parent is a
per-engine seed (vLLM's NONE_HASH): random for each engine unless PYTHONHASHSEED is set, so
hashes never match across processes by accident and are reproducible when asked to be.
"""

from __future__ import annotations

import array
import hashlib
import os
from collections.abc import Callable, Sequence

BlockHash = bytes
HASH_ALGOS = ("sha256", "xxhash")


def get_hash_fn(algo: str) -> Callable[[bytes], bytes]:
    if algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if algo == "xxhash":
        try:
            import xxhash
        except ImportError:
            raise ValueError("prefix_caching_hash_algo 'xxhash' needs the xxhash package "
                             "(pip install xxhash); or use 'sha256'.") from None
        return xxhash.xxh3_128_digest
    raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}.")


def init_none_hash(hash_fn: Callable[[bytes], bytes]) -> BlockHash:
    """The parent hash of every first block; a hash itself, so every parent has one length and
    the hashed bytes stay unambiguous."""
    seed = os.environ.get("PYTHONHASHSEED")
    return hash_fn(os.urandom(32) if seed is None else seed.encode())


def hash_block_tokens(hash_fn: Callable[[bytes], bytes], parent_hash: BlockHash,
                      token_ids: Sequence[int], extra_keys: tuple) -> BlockHash:
    """A full block's hash. The parent hash and the block's tokens have fixed lengths, so the
    extra keys' repr after them cannot shift into either."""
    return hash_fn(parent_hash + array.array("i", token_ids).tobytes()
                   + repr(extra_keys).encode())


def block_extra_keys(cache_salt: str | None, share_group: int | None, lora_key: tuple,
                     block_index: int) -> tuple:
    """What besides the tokens decides a block's KV. The salt (and, with caching off, the n > 1
    group that shares a prompt) and the LoRA adapter go into the first block only: the chain
    carries them on."""
    if block_index == 0 and (cache_salt is not None or share_group is not None or lora_key):
        return (cache_salt, share_group, *lora_key)
    return ()
