"""What the engine asks of a draft proposer: after a step, drafts for the requests that got
tokens, all at once (a draft model runs them as one batch)."""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    def propose_batch(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """request id -> its tokens so far; returns request id -> up to k draft tokens to
        follow them (a request left out gets none)."""


class PerRequestProposer:
    """A proposer whose drafts for one request depend on that request's tokens only."""

    def propose(self, token_ids: list[int]) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        return {request_id: self.propose(tokens) for request_id, tokens in token_ids.items()}
