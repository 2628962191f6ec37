"""The sampling rows of a step with speculative decoding (numpy, host side).

Without drafts a step samples once per sequence, after its last token. With drafts it samples
at N rows: a sequence with d drafts has d + 1 rows (after its last known token and after each
draft), every other sequence one. N is fixed per bucket (T tokens, S sequences) so nothing
recompiles: at most max_spec_seqs sequences carry drafts (the scheduler grants none in a step
whose batch reaches disable_by_batch_size), so S + max_spec_seqs * k rows, and never more than T.
"""

from __future__ import annotations

import numpy as np

from jaxllm.sample import build_sampling_metadata
from jaxllm.sample.rejection import DraftRows
from jaxllm.worker.request_states import ScheduledChunk


class DraftRowBuilder:
    def __init__(self, num_spec_tokens: int, max_spec_seqs: int, garbage_row: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.max_spec_seqs = max_spec_seqs
        self.garbage_row = garbage_row

    def num_rows(self, num_tokens_padded: int, num_seqs_padded: int) -> int:
        return min(num_tokens_padded, num_seqs_padded + self.max_spec_seqs * self.num_spec_tokens)

    def apply(self, inputs, chunks: list[ScheduledChunk]) -> np.ndarray:
        """Turns a step's StepInputs (one sampling row per sequence, sampling metadata unset)
        into one with a row per sampling position: logits_indices, seq_rows and sampling are
        then [N], draft tokens are kept out of the penalty counts, and draft_rows is set.
        Returns each chunk's first row."""
        batch = inputs.batch
        num_seqs, num_seqs_padded = len(chunks), len(batch.kv_lens)
        num_rows_padded = self.num_rows(len(batch.token_ids), num_seqs_padded)
        num_drafts = np.fromiter((c.num_draft_tokens for c in chunks), np.int32, num_seqs)
        rows_per_seq = num_drafts + 1
        num_rows = int(rows_per_seq.sum())
        if num_rows > num_rows_padded:
            raise ValueError(f"{num_rows} sampling rows exceed the bucket's {num_rows_padded}.")
        first_row = np.zeros(num_seqs_padded, np.int32)
        first_row[1:num_seqs] = np.cumsum(rows_per_seq)[:-1]
        row_seq = np.full(num_rows_padded, max(num_seqs_padded - 1, 0), np.int32)
        row_seq[:num_rows] = np.repeat(np.arange(num_seqs, dtype=np.int32), rows_per_seq)
        seq = row_seq[:num_rows]
        offset = np.arange(num_rows, dtype=np.int32) - first_row[seq]  # position in its run
        ends = batch.cu_q_lens[1:num_seqs + 1]
        logits_indices = np.zeros(num_rows_padded, np.int32)
        logits_indices[:num_rows] = ends[seq] - rows_per_seq[seq] + offset
        is_draft = offset < num_drafts[seq]  # the row's next token is a draft
        draft_token = logits_indices[:num_rows][is_draft] + 1
        draft_ids = np.full(num_rows_padded, -1, np.int32)
        draft_ids[:num_rows][is_draft] = batch.token_ids[draft_token]
        inputs.token_rows[draft_token] = self.garbage_row  # counted once accepted
        batch.logits_indices = logits_indices
        seq_rows = np.full(num_rows_padded, self.garbage_row, np.int32)
        seq_rows[:num_rows] = inputs.seq_rows[seq]
        inputs.seq_rows = seq_rows
        inputs.sampling = self._sampling_metadata(chunks, seq, offset, num_rows_padded)
        inputs.draft_rows = DraftRows(
            draft_ids=draft_ids, row_seq=row_seq, first_row=first_row,
            prior_draft_ids=self._prior_drafts(batch.token_ids, ends - num_drafts, seq, offset,
                                               num_rows_padded))
        return first_row[:num_seqs]

    def _prior_drafts(self, token_ids: np.ndarray, first_draft_token: np.ndarray,
                      seq: np.ndarray, offset: np.ndarray, num_rows_padded: int) -> np.ndarray:
        """[N, k]: row r's earlier drafts in its run (the drafts before its position)."""
        prior = np.full((num_rows_padded, self.num_spec_tokens), -1, np.int32)
        index = np.arange(self.num_spec_tokens, dtype=np.int32)[None, :]
        source = np.minimum(first_draft_token[seq][:, None] + index, len(token_ids) - 1)
        prior[:len(seq)] = np.where(index < offset[:, None], token_ids[source], -1)
        return prior

    @staticmethod
    def _sampling_metadata(chunks: list[ScheduledChunk], seq: np.ndarray, offset: np.ndarray,
                           num_rows_padded: int):
        """Row r samples output index (its chunk's) + its offset, with its key and min-tokens
        state at that index."""
        params, output_indices, seeds = [], [], []
        for s, j in zip(seq.tolist(), offset.tolist()):
            c = chunks[s]
            params.append(c.state.sampling_params if c.samples else None)
            output_indices.append(c.num_output_tokens + j)
            seeds.append(c.state.sampling_params.seed)
        return build_sampling_metadata(params, output_indices=output_indices, seeds=seeds,
                                       num_seqs_padded=num_rows_padded)
