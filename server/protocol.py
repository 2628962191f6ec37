"""OpenAI-compatible request and response schemas as msgspec Structs.

Requests decode strictly on types (no "1" for an int, no float for an int, no bool for a number).
Unknown fields are ignored with a warning, as vLLM does: the openai client and its users send
fields (user, metadata, ...) that a server without them should still accept. Fields whose
meaning the server does not implement (structured outputs, tools, logit_bias, best_of, ...) are
decoded only to be refused with a 400 naming them (`unsupported_field`): a client must never
believe it got JSON or a tool call when it got free text.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

# ---- requests ---------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share, names and defaults as vLLM's OpenAI server."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: logprobs of the prompt tokens
    # vLLM's extension: requests share cached prefix KV only under the same salt (tenants).
    cache_salt: str | None = None
    # Not implemented: refused unless absent or harmless (unsupported_field).
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of strings, token ids, or a list of token-id lists; msgspec allows one
    # array type per union, so the list's homogeneity is checked after decoding.
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and token_ids per choice


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None  # not implemented: refused when present


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, bool | int | float | str] | None = None
    tools: Any = None  # not implemented: refused when given
    tool_choice: Any = None  # only "none" (or absent) without tools


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def unsupported_field(request: SamplingFields) -> str | None:
    """The first field of `request` that asks for something not implemented, or None."""
    if request.best_of is not None and request.best_of != 1:
        return "best_of"
    if request.logit_bias:
        return "logit_bias"
    if request.response_format is not None and request.response_format != {"type": "text"}:
        return "response_format"
    guided = next((name for name in _GUIDED if getattr(request, name) is not None), None)
    if guided is not None:
        return guided
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        return "stream_options.continuous_usage_stats"
    if isinstance(request, ChatCompletionRequest):
        return _unsupported_chat_field(request)
    return None


def _unsupported_chat_field(request: ChatCompletionRequest) -> str | None:
    if request.tools:
        return "tools"
    if request.tool_choice not in (None, "none"):
        return "tool_choice"
    if any(message.tool_calls for message in request.messages):
        return "messages.tool_calls"
    return None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---- responses --------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class PromptTokenUsageInfo(msgspec.Struct):
    cached_tokens: int  # prompt tokens found in the prefix cache


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class ModelCard(msgspec.Struct):
    id: str
    max_model_len: int
    object: str = "model"
    created: int = msgspec.field(default_factory=_now)
    owned_by: str = "jaxllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_int_id: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class LogprobEntry(msgspec.Struct):
    """vLLM's Logprob as its prompt_logprobs serialise it."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# One dict per prompt position (token id -> entry); the first position has none.
PromptLogprobs = list[dict[int, LogprobEntry] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (first chunk when streamed)
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(msgspec.Struct):
    id: str
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=_now)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(msgspec.Struct):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None
    created: int = msgspec.field(default_factory=_now)


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"
    created: int = msgspec.field(default_factory=_now)


class CompletionChunk(msgspec.Struct):
    id: str
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"
    created: int = msgspec.field(default_factory=_now)


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str
