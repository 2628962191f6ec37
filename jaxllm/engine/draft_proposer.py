"""Drafts from a smaller model with the target's vocabulary (vLLM's method "draft_model").

The draft runs in an EngineCore of its own (built by jaxllm/engine/builder.py from the target's
config: same max_model_len, block size, token budget and buckets, synchronous scheduling, its
own KV pool of as many blocks as the target's, prefix caching on). Each round, after a target
step, every request that got tokens becomes a draft request whose prompt is its tokens so far,
greedy (temperature 0, as vLLM's draft proposer) for up to k tokens, and the draft engine steps
until all of them finish: one draft step per proposed position for the whole batch, the first
one computing each request's tokens not yet cached.

Why a whole engine per round rather than the draft's KV kept beside the target's under the
same block tables (the issue's sketch, vLLM's layout): the draft engine reuses the scheduler,
runner, warm-up and prefix cache as they are, and nothing of it outlives a round. Its requests
finish every round, so a request the target finishes, aborts or preempts leaves nothing behind;
their full blocks stay in the draft's prefix cache (LRU), so the next round recomputes only the
tokens accepted since and the request's last partial block. Rejected drafts need no rollback:
the next round's prompt simply does not contain them. The price of this simplicity: each round
re-hashes a request's full blocks (host time linear in its length) and recomputes its last
partial block; drafting k tokens takes k launches, not one program. Correctness does not rest
on the drafts (the target verifies them with exact rejection sampling); only the acceptance
rate does.
"""

from __future__ import annotations

from jaxllm.engine.engine_core import EngineCore
from jaxllm.sampling_params import SamplingParams


class DraftModelProposer:
    def __init__(self, core: EngineCore, num_speculative_tokens: int) -> None:
        self.core = core  # the draft's engine
        self.k = num_speculative_tokens

    def propose_batch(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """Up to k greedy draft tokens after each request's tokens, all requests batched."""
        for request_id, tokens in token_ids.items():
            num_drafts = min(self.k, self.core.max_model_len - len(tokens))
            if num_drafts <= 0:
                continue
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=num_drafts)
            try:
                self.core.add_request(request_id, tokens, params)
            except ValueError:  # longer than the draft's KV pool can hold: no drafts
                continue
        drafts = {}
        while self.core.has_unfinished_requests():
            for output in self.core.step():
                if output.finished:
                    drafts[output.request_id] = output.outputs[0].token_ids
        return drafts
