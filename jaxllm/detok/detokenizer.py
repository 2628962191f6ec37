"""Incremental detokenisation of one output sequence, with stop strings (host side, no JAX).

Decoding goes through tokenizers' DecodeStream, which holds back a token until its bytes form
complete UTF-8 characters, so streamed text never contains a replacement character for an
emoji or CJK character that is split across byte-level tokens. The stream is primed with the
end of the prompt, as vLLM's FastIncrementalDetokenizer does, so a first output token that
starts with a space (or a SentencePiece word marker) keeps it.

Stop strings follow vLLM: they are searched only where a match can end in the new text, only
once the sequence has more than min_tokens output tokens, and the text is cut before the stop
string (or after it with include_stop_str_in_output). Streaming holds back the last
len(longest stop string) - 1 characters until the sequence finishes, so a client never sees a
partial stop string that is later cut away. One deliberate difference from vLLM: when several
stop strings end in the same update, the one that starts first wins (vLLM takes the first in
list order).
"""

from __future__ import annotations

import logging
from array import array

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from jaxllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"
_PROMPT_PRIMING_TOKENS = (4, 24)  # try prompt suffixes of this many tokens, shortest first


def backend_tokenizer(tokenizer) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or the object itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: incremental "
                         "detokenisation needs a `tokenizers.Tokenizer` backend.")
    return backend


def find_stop_string(text: str, new_char_count: int, stop: list[str],
                     include_in_output: bool) -> tuple[str, int] | None:
    """The stop string that ends in the last new_char_count characters of text and starts first,
    with the length text must be cut to; None when no stop string ends there."""
    best: tuple[str, int] | None = None
    for stop_str in stop:
        # A match must end inside the new text, so it starts at most len(stop_str) - 1 before.
        start = text.find(stop_str, max(0, len(text) - new_char_count - len(stop_str) + 1))
        if start != -1 and (best is None or start < best[1]):
            best = (stop_str, start)
    if best is None:
        return None
    stop_str, start = best
    return stop_str, start + len(stop_str) if include_in_output else start


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int],
                 sampling_params: SamplingParams) -> None:
        self.tokenizer = backend_tokenizer(tokenizer)
        self.skip_special_tokens = sampling_params.skip_special_tokens
        self.stop = list(sampling_params.stop or [])
        self.include_stop_str_in_output = sampling_params.include_stop_str_in_output
        self.min_tokens = sampling_params.min_tokens
        self.stop_buffer_length = (max(map(len, self.stop)) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        self.token_ids = array("i")  # output tokens only (C ints: no references to collect)
        self.output_text = ""
        # Without stop strings a request that wants only its final output needs no text before
        # it finishes: its tokens wait here and go through the stream then (the same steps).
        self._deferred = (not self.stop and
                         sampling_params.output_kind == RequestOutputKind.FINAL_ONLY)
        self._pending = array("i")  # deferred tokens whose text is not in output_text yet
        self._streamed_chars = 0
        self.stream = DecodeStream(ids=self._priming_ids(prompt_token_ids),
                                   skip_special_tokens=self.skip_special_tokens)

    def _priming_ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt suffix (4 to 23 tokens) that decodes without a broken character,
        so the stream's prefix is clean text."""
        shortest, longest = _PROMPT_PRIMING_TOKENS
        if len(prompt_token_ids) <= shortest:
            return list(prompt_token_ids)
        for n in range(shortest, min(len(prompt_token_ids) + 1, longest)):
            suffix = list(prompt_token_ids[-n:])
            if "\ufffd" not in self.tokenizer.decode(suffix, self.skip_special_tokens):
                return suffix
        return []

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Appends new output tokens; returns the stop string that ended the sequence, if any.
        stop_terminated: the last token is an EOS / stop token id, whose text is left out unless
        include_stop_str_in_output (as vLLM). Stop strings are checked after each token, as if
        the tokens came one per step: with several (speculative decoding) the first token that
        completes one ends the sequence, and the tokens after it are dropped (self.token_ids
        keeps the outputs up to it)."""
        if not new_token_ids:
            return None
        skipped = None
        if stop_terminated and not self.include_stop_str_in_output:
            skipped, new_token_ids = new_token_ids[-1], new_token_ids[:-1]
        if self._deferred:
            self.token_ids.extend(new_token_ids)
            self._pending.extend(new_token_ids)
            new_token_ids = ()
        for index, token_id in enumerate(new_token_ids):
            stop_check_offset = len(self.output_text)
            self.token_ids.append(token_id)
            self.output_text += self._step(token_id) or ""
            ends_by_id = stop_terminated and index == len(new_token_ids) - 1
            if not self.stop or len(self.token_ids) <= self.min_tokens or ends_by_id:
                continue
            found = find_stop_string(self.output_text, len(self.output_text) - stop_check_offset,
                                     self.stop, self.include_stop_str_in_output)
            if found is not None:
                stop_str, cut_to = found
                self.output_text = self.output_text[:cut_to]
                return stop_str
        if skipped is not None:
            self.token_ids.append(skipped)
        return None

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.tokenizer, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX_ERR_MSG):
                raise
            # Some tokenizers decode a longer id list to text that does not extend the shorter
            # one's, which breaks DecodeStream's state; restart it from this token (as vLLM).
            logger.warning("Detokenizer: invalid prefix, resetting the decode stream.")
            self.stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            return self.stream.step(self.tokenizer, token_id)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to stream: everything (delta=False) or what is new since the last delta call,
        minus the held-back tail that could still turn out to be the start of a stop string."""
        if self._pending:
            self.output_text += "".join(filter(None, map(self._step, self._pending)))
            self._pending = array("i")
        buffer = 0 if finished else self.stop_buffer_length
        end = len(self.output_text) - buffer
        if not delta:
            return self.output_text[:end]
        start = self._streamed_chars
        if end <= start:
            return ""
        self._streamed_chars = end
        return self.output_text[start:end]
