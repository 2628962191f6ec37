"""A request as the scheduler sees it: token ids and how many of them are in the KV cache."""

from __future__ import annotations

import enum
import time
from array import array

from jaxllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, arrival_time: float | None = None,
                 cache_salt: str | None = None, share_group: int | None = None,
                 lora_request=None, parent_request_id: str | None = None) -> None:
        self.request_id = request_id
        # The request it is a child of (n > 1), else its own id: the waiting queue takes turns
        # between parents.
        self.parent_request_id = request_id if parent_request_id is None else parent_request_id
        # Token ids in C int arrays, not lists: a full garbage collection visits every element
        # of a list (a long prompt is thousands of references, each request holds several),
        # none of an array's, and while serving such a pause outlasts the step it delays.
        self.prompt_token_ids = array("i", prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids = array("i")
        self.all_token_ids = array("i", prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens granted to be sampled by launched steps whose results are not in yet (async
        # scheduling, as vLLM's num_output_placeholders); they follow all_token_ids.
        self.num_output_placeholders = 0
        # Draft tokens proposed to follow all_token_ids (speculative decoding), verified when
        # the scheduler grants them.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prefix caching: requests share KV only under the same salt (tenants); share_group
        # lets the n > 1 children of one request share their prompt with caching off.
        self.cache_salt = cache_salt
        self.share_group = share_group
        # The LoRA adapter (jaxllm.lora.LoRARequest) or None: read only for its id and path.
        self.lora_request = lora_request
        self.block_hashes: list[bytes] = []  # of its full blocks of known tokens, in order
        self.num_cached_tokens: int | None = None  # prefix cache hit at its first admission

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def lora_key(self) -> tuple:
        """What of the adapter decides the KV (its id and files), () for the base model."""
        lora = self.lora_request
        return () if lora is None else ("lora", lora.lora_int_id, lora.lora_path)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)
