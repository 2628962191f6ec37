"""StepBatch: the ragged batch a model step reads (built on the host by jaxllm/worker/batch.py).

T = padded number of tokens, S = padded number of sequences, B = max blocks per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


@jax.tree_util.register_dataclass
@dataclass
class StepBatch:
    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32: block_id * block_size + offset
    block_tables: jax.Array  # [S, B] int32
    cu_q_lens: jax.Array  # [S + 1] int32: query start of each sequence in the flat batch
    kv_lens: jax.Array  # [S] int32: KV length after this step's tokens are written
    num_seqs: jax.Array  # [1] int32: live sequences (the rest are padding)
    logits_indices: jax.Array  # [S] int32: flat index of each sequence's last scheduled token
    lora_slots: jax.Array | None = None  # [T] int32: each token's LoRA slot (0: none); None: off
