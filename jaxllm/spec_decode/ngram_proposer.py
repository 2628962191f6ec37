"""Prompt-lookup (n-gram) drafts, on the host: no model, no device work.

vLLM's algorithm: the longest suffix of the request's tokens, between prompt_lookup_max and
prompt_lookup_min tokens long, that also occurs earlier in its tokens (prompt and outputs); of
its earlier occurrences the first one; the draft is up to k tokens that followed it.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxllm.spec_decode.proposer import PerRequestProposer


class NgramProposer(PerRequestProposer):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int, max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k draft tokens to follow token_ids (none without a match)."""
        num_tokens = len(token_ids)
        k = min(self.k, self.max_model_len - num_tokens)
        if num_tokens <= self.min_n or k <= 0:
            return []
        tokens = np.asarray(token_ids, np.int64)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            # windows over tokens[:-1]: an occurrence that ends before the suffix's last token,
            # so at least one token follows it
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[0]) + n
                return list(token_ids[start:start + k])
        return []
