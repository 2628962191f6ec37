"""Turns scheduler updates into RequestOutputs: detokenises, finds stop strings, groups n > 1.

A request with n > 1 runs as n child requests ("{parent}#{i}") that share nothing but their
prompt (and its KV blocks); their parent collects one CompletionOutput per child.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from jaxllm.core.request import Request, RequestStatus
from jaxllm.detok.detokenizer import IncrementalDetokenizer
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
from jaxllm.sampling_params import RequestOutputKind


@dataclass
class ChildState:
    index: int
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer (dummy presets)
    logprobs: list | None  # SampleLogprobs when asked
    cumulative_logprob: float | None
    completion: CompletionOutput | None = None
    num_output_tokens: int = 0  # of the request's outputs, those already processed


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: array  # C ints (see Request)
    children: dict[str, ChildState] = field(default_factory=dict)
    num_unfinished: int = 0
    prompt_logprobs: list | None = None  # PromptLogprobs when asked: [None, {id: Logprob}, ...]
    first_child: Request | None = None  # whose prefix cache hit the outputs report


def child_request_id(parent_id: str, index: int, n: int) -> str:
    return parent_id if n == 1 else f"{parent_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.parent_of: dict[str, str] = {}  # child id -> parent id

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: array,
                    children: list[Request]) -> None:
        parent = ParentState(parent_id, prompt, prompt_token_ids, num_unfinished=len(children),
                             first_child=children[0])
        if children[0].sampling_params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        for index, child in enumerate(children):
            params = child.sampling_params
            parent.children[child.request_id] = ChildState(
                index=index,
                detokenizer=(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
                             if self.tokenizer is not None else None),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.parent_of[child.request_id] = parent_id
        self.parents[parent_id] = parent

    def child_ids(self, parent_id: str) -> list[str]:
        parent = self.parents.get(parent_id)
        return list(parent.children) if parent else []

    def process(self, updated: list[Request], logprobs: dict) -> tuple[list[RequestOutput],
                                                                      list[Request]]:
        """updated: the requests that got tokens this step; logprobs: request id -> one entry
        per new token. Returns the outputs, and the requests a stop string finished (the engine
        frees them)."""
        stopped_by_string, touched = [], {}
        for request in updated:
            parent_id = self.parent_of.get(request.request_id)
            if parent_id is None:
                continue
            parent = self.parents[parent_id]
            child = parent.children[request.request_id]
            new_tokens = request.output_token_ids[child.num_output_tokens:]
            child.num_output_tokens = request.num_output_tokens
            # EOS or a stop token id ended it: the detokenizer leaves that token's text out.
            stop_terminated = request.status == RequestStatus.FINISHED_STOPPED
            stop_str = (child.detokenizer.update(new_tokens, stop_terminated)
                        if child.detokenizer else None)
            output_token_ids = request.output_token_ids
            if stop_str is not None:
                # Tokens accepted in the same step after the stop string are dropped.
                output_token_ids = output_token_ids[:len(child.detokenizer.token_ids)]
                num_dropped = len(request.output_token_ids) - len(output_token_ids)
                new_tokens = new_tokens[:len(new_tokens) - num_dropped]
                request.stop_reason = stop_str
                if not request.is_finished():
                    stopped_by_string.append(request)
            for token, entry in zip(new_tokens, logprobs.get(request.request_id, ())):
                self._append_logprobs(child, token, entry)
            finish_reason = "stop" if stop_str is not None else request.get_finished_reason()
            final_only = request.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
            if finish_reason is None and final_only:
                continue
            text = (child.detokenizer.get_next_output_text(finish_reason is not None, delta=False)
                    if child.detokenizer else "")
            child.completion = CompletionOutput(
                index=child.index, text=text,
                token_ids=list(output_token_ids),
                cumulative_logprob=child.cumulative_logprob,
                logprobs=child.logprobs, finish_reason=finish_reason,
                stop_reason=request.stop_reason)
            if finish_reason is not None:
                parent.num_unfinished -= 1
            if parent.num_unfinished == 0 or not final_only:
                touched[parent_id] = parent
        outputs = [self._make_output(parent) for parent in touched.values()]
        return outputs, stopped_by_string

    def record_prompt_logprobs(self, prompt_logprobs: dict) -> None:
        """child id -> [(prompt position, entry)]; a position recomputed after a preemption
        simply overwrites itself."""
        for child_id, entries in prompt_logprobs.items():
            parent = self.parents.get(self.parent_of.get(child_id))
            if parent is None or parent.prompt_logprobs is None:
                continue
            for position, entry in entries:
                parent.prompt_logprobs[position] = self._logprob_dict(
                    parent.prompt_token_ids[position], entry)

    def _logprob_dict(self, token: int, entry) -> dict[int, Logprob]:
        chosen_logprob, chosen_rank, top_ids, top_logprobs = entry
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids: None)
        step = {tid: Logprob(lp, rank + 1, decode([tid]))
                for rank, (tid, lp) in enumerate(zip(top_ids, top_logprobs))}
        step[token] = Logprob(chosen_logprob, chosen_rank, decode([token]))
        return step

    def _append_logprobs(self, child: ChildState, token: int, entry) -> None:
        child.logprobs.append(self._logprob_dict(token, entry))
        child.cumulative_logprob += entry[0]

    def _make_output(self, parent: ParentState) -> RequestOutput:
        finished = parent.num_unfinished == 0
        completions = [c.completion if c.completion is not None
                       else CompletionOutput(index=c.index, text="", token_ids=[])
                       for c in sorted(parent.children.values(), key=lambda c: c.index)]
        if finished:
            self._forget(parent.request_id)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             completions, finished, prompt_logprobs=parent.prompt_logprobs,
                             num_cached_tokens=parent.first_child.num_cached_tokens)

    def abort(self, parent_id: str) -> None:
        self._forget(parent_id)

    def _forget(self, parent_id: str) -> None:
        parent = self.parents.pop(parent_id, None)
        if parent is not None:
            for child_id in parent.children:
                self.parent_of.pop(child_id, None)
