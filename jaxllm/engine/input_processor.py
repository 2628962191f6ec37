"""Prompts to token ids, written once for `LLM` and the server: tokenising, the chat template,
and the checks against max_model_len and the vocabulary, with vLLM's messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class InputError(ValueError):
    """A prompt the engine cannot take; `param` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    text: str | None  # None for token ids without a tokenizer


class InputProcessor:
    """Stateless but for the tokenizer, which the caller must not share across threads."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int,
                 chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # Ids past the tokenizer's own vocabulary decode to nothing: refuse them too.
        self.vocab_size = vocab_size if tokenizer is None else min(vocab_size, len(tokenizer))
        self.chat_template = chat_template
        # No token spells more characters than its vocabulary entry holds (byte-level and
        # SentencePiece entries alike), special tokens included.
        longest = 0 if tokenizer is None else max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 2 * max_model_len * longest  # 2: normalisers may drop some

    def require_tokenizer(self, param: str | None = None):
        if self.tokenizer is None:
            raise InputError("This server was started without a tokenizer: only token-id "
                             "prompts on /v1/completions are supported.", param)
        return self.tokenizer

    # -- prompts --------------------------------------------------------------------------------
    def process(self, prompt: str | list[int] | dict[str, Any]) -> ProcessedPrompt:
        """`LLM`'s prompt forms: text, token ids, or {"prompt"[, "prompt_token_ids"]}."""
        if isinstance(prompt, str):
            return self.from_text(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            return self.from_text(prompt["prompt"])
        # Token ids: the text is what the caller gave (vLLM's RequestOutput.prompt).
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
        ids = ids if isinstance(ids, np.ndarray) else list(ids)
        self.check_vocab(ids)
        return self._checked(ids, text)

    def from_text(self, text: str, add_special_tokens: bool = True,
                  param: str = "prompt") -> ProcessedPrompt:
        tokenizer = self.require_tokenizer(param)
        self._check_text_size(text, param)
        return self._checked(tokenizer.encode(text, add_special_tokens=add_special_tokens),
                             text, param)

    def from_token_ids(self, token_ids: list[int], param: str = "prompt") -> ProcessedPrompt:
        self._checked(token_ids, None, param)  # before decoding an id list of any length
        self.check_vocab(token_ids, param)
        text = None if self.tokenizer is None else self.tokenizer.decode(token_ids)
        return ProcessedPrompt(token_ids, text)

    def from_chat(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True,
                  continue_final_message: bool = False, chat_template: str | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> ProcessedPrompt:
        """The conversation through the chat template (which adds BOS itself)."""
        tokenizer = self.require_tokenizer("messages")
        if add_generation_prompt and continue_final_message:
            raise InputError("continue_final_message and add_generation_prompt cannot both be "
                             "true.", "continue_final_message")
        try:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template or self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(template_kwargs or {}))
        except Exception as error:  # noqa: BLE001 - template errors are the request's fault
            raise InputError(f"Could not apply the chat template: {error}", "messages") from None
        self._check_text_size(text, "messages")
        return self._checked(tokenizer.encode(text, add_special_tokens=False), text, "messages")

    def detokenize(self, token_ids: list[int]) -> str:
        self.check_vocab(token_ids, "tokens")
        return self.require_tokenizer("tokens").decode(token_ids)

    # -- checks ---------------------------------------------------------------------------------
    def check_vocab(self, token_ids: list[int], param: str = "prompt") -> None:
        if len(token_ids) and _in_range(token_ids, self.vocab_size):
            return
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InputError(f"Token id {bad} is out of vocabulary (vocab size "
                             f"{self.vocab_size}).", param)

    def check_context(self, prompt_len: int, max_tokens: int | None) -> None:
        """The prompt and the tokens asked for fit max_model_len (the OpenAI server's wording);
        max_tokens None means "up to the limit", which needs room for one token."""
        if max_tokens is None and prompt_len >= self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {prompt_len} input tokens. Please reduce the length of the "
                f"input messages.", "messages")
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                f"completion.", "max_tokens")

    def _checked(self, token_ids: list[int], text: str | None,
                 param: str = "prompt") -> ProcessedPrompt:
        if not len(token_ids):
            raise InputError("The decoder prompt cannot be empty.", param)
        if len(token_ids) > self.max_model_len:
            raise InputError(
                f"The decoder prompt (length {len(token_ids)}) is longer than the maximum model "
                f"length of {self.max_model_len}. Make sure that `max_model_len` is no smaller "
                f"than the number of text tokens.", param)
        return ProcessedPrompt(token_ids, text)

    def _check_text_size(self, text: str, param: str) -> None:
        """Refuses, before tokenising it, text too long to fit max_model_len tokens of the
        longest token: tokenising a prompt of tens of MB takes a CPU minute."""
        if len(text) > self.max_prompt_chars:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {len(text)} characters, more than {self.max_model_len} "
                f"tokens can hold. Please reduce the length of the input messages.", param)


def _in_range(token_ids, vocab_size: int) -> bool:
    """Every id in [0, vocab_size): min() and max() at C speed for a list, numpy's for an
    array (a Python loop per token costs more than the step at embedding batch sizes)."""
    if isinstance(token_ids, np.ndarray):
        return 0 <= token_ids.min() and token_ids.max() < vocab_size
    return 0 <= min(token_ids) and max(token_ids) < vocab_size
