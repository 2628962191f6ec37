"""The ragged batch of one step: every scheduled token of every sequence, flattened and padded.

Shapes are fixed by two bucket sizes, so jit compiles a bounded set of programs:
  T = padded number of tokens, S = padded number of sequences, B = max blocks per sequence.
Padding tokens write their K/V into block 0, which the block pool never hands out; padding
sequences have q_len 0 and kv_len 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from jaxllm.models.batch import StepBatch

PAD_SLOT = 0  # block 0, offset 0: reserved for padding writes


@dataclass
class SeqChunk:
    """What one sequence contributes to a step."""
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] (= num_computed_tokens)
    block_ids: list[int] | None = None  # the whole block table (unless passed as block_tables)


def build_step_batch(chunks: list[SeqChunk], num_tokens_padded: int, num_seqs_padded: int,
                     max_blocks_per_seq: int, block_size: int,
                     block_tables: np.ndarray | None = None) -> StepBatch:
    """Flattens chunks into numpy arrays of the bucket's shape (host side, no per-token loop:
    this runs every step, for up to max_num_seqs sequences). block_tables [S, B], when given,
    replaces the chunks' block_ids."""
    num_seqs = len(chunks)
    q_lens = np.fromiter((len(c.token_ids) for c in chunks), np.int32, num_seqs)
    start_pos = np.fromiter((c.start_pos for c in chunks), np.int32, num_seqs)
    cu_q_lens = np.zeros(num_seqs_padded + 1, np.int32)
    np.cumsum(q_lens, out=cu_q_lens[1:num_seqs + 1])
    num_tokens = int(cu_q_lens[num_seqs])
    if num_tokens > num_tokens_padded or num_seqs > num_seqs_padded:
        raise ValueError(f"{num_tokens} tokens / {num_seqs} seqs exceed the bucket "
                         f"({num_tokens_padded}, {num_seqs_padded}).")
    cu_q_lens[num_seqs + 1:] = num_tokens
    if block_tables is None:
        block_tables = np.zeros((num_seqs_padded, max_blocks_per_seq), np.int32)
        num_blocks = np.fromiter((len(c.block_ids) for c in chunks), np.int32, num_seqs)
        # A row-major boolean assignment fills each row's first num_blocks entries in order.
        block_tables[:num_seqs][np.arange(max_blocks_per_seq) < num_blocks[:, None]] = (
            np.fromiter(itertools.chain.from_iterable(c.block_ids for c in chunks), np.int32,
                        int(num_blocks.sum())))
    seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int32), q_lens)  # [num_tokens]
    pos = start_pos[seq_of_token] + np.arange(num_tokens, dtype=np.int32) - cu_q_lens[seq_of_token]
    token_ids = np.zeros(num_tokens_padded, np.int32)
    token_ids[:num_tokens] = np.fromiter(
        itertools.chain.from_iterable(c.token_ids for c in chunks), np.int32, num_tokens)
    positions = np.zeros(num_tokens_padded, np.int32)
    positions[:num_tokens] = pos
    slot_mapping = np.full(num_tokens_padded, PAD_SLOT, np.int32)
    slot_mapping[:num_tokens] = (block_tables[seq_of_token, pos // block_size] * block_size
                                 + pos % block_size)
    kv_lens = np.zeros(num_seqs_padded, np.int32)
    kv_lens[:num_seqs] = start_pos + q_lens
    logits_indices = np.zeros(num_seqs_padded, np.int32)
    logits_indices[:num_seqs] = cu_q_lens[1:num_seqs + 1] - 1
    return StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                     block_tables=block_tables, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                     num_seqs=np.array([num_seqs], np.int32), logits_indices=logits_indices)
