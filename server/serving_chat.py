"""POST /v1/chat/completions: messages through the chat template, streamed or not."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.responses import Response, StreamingResponse

from jaxllm.engine.input_processor import ProcessedPrompt
from jaxllm.outputs import SampleLogprobs
from jaxllm.sampling_params import MAX_LOGPROBS
from jaxllm.server.errors import OpenAIError
from jaxllm.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                             ChatCompletionResponse, ChatLogprobs, ChatMessage,
                             ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob,
                             DeltaMessage, TopLogprob)
from jaxllm.server.serving import (SSE_DONE, DeltaTracker, OpenAIServing, clamp_logprob,
                            prompt_logprobs_body, sse, stream_error, token_text, top_entries,
                            usage)

_ROLES = ("system", "developer", "user", "assistant", "tool")
# Arguments of apply_chat_template that chat_template_kwargs may not override.
_RESERVED_KWARGS = {"conversation", "chat_template", "tokenize", "add_generation_prompt",
                    "continue_final_message", "return_dict", "return_tensors", "tools",
                    "documents", "padding", "truncation", "max_length"}
_ENCODER = msgspec.json.Encoder()


def conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as the chat template reads them; only text content is supported."""
    if not messages:
        raise OpenAIError("messages must not be empty.", param="messages")
    return [{"role": _role(m), "content": _content_text(m)} for m in messages]


async def render_chat(serving: OpenAIServing, messages: list[ChatMessage],
                      add_generation_prompt: bool, continue_final_message: bool = False,
                      template_kwargs: dict | None = None) -> ProcessedPrompt:
    """The conversation as prompt text and token ids, rendered off the event loop."""
    serving.require_tokenizer("messages")
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_KWARGS}
    return await serving.off_loop(functools.partial(
        serving.processor.from_chat, conversation(messages), add_generation_prompt,
        continue_final_message, template_kwargs=kwargs))


def _role(message: ChatMessage) -> str:
    if message.role not in _ROLES:
        raise OpenAIError(f"Unknown message role {message.role!r}; expected one of {_ROLES}.",
                          param="messages")
    return message.role


def _content_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise OpenAIError(f"Only text content parts are supported, got {part.type!r}.",
                              param="messages")
        parts.append(part.text)
    return "\n".join(parts)


class ChatServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer

    async def create(self, request: ChatCompletionRequest) -> Response:
        model = self.serving.check_model(request.model)
        num_logprobs = _num_logprobs(request)
        self.serving.check_request(request, 1)  # before the template's work
        prompt = await render_chat(self.serving, request.messages,
                                   request.add_generation_prompt,
                                   request.continue_final_message, request.chat_template_kwargs)
        max_tokens = (request.max_completion_tokens if request.max_completion_tokens is not None
                      else request.max_tokens)
        params = self.serving.sampling_params(request, max_tokens, len(prompt.token_ids),
                                              num_logprobs, request.prompt_logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = await self.serving.start([prompt], params, request_id, request.cache_salt,
                                           self.serving.lora_for(request.model))
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(self._stream(request, outputs, request_id, model,
                                                  num_logprobs, include_usage),
                                     media_type="text/event-stream")
        final = None
        try:
            async for _, output in outputs:
                final = output
        finally:
            await outputs.aclose()
        choices = [ChatChoice(c.index, ChatResponseMessage(content=c.text),
                              self._logprobs(c.token_ids, c.logprobs, num_logprobs),
                              c.finish_reason, c.stop_reason) for c in final.outputs]
        body = ChatCompletionResponse(request_id, model, choices, usage([final]),
                                      prompt_logprobs=prompt_logprobs_body(final.prompt_logprobs))
        return Response(_ENCODER.encode(body), media_type="application/json")

    def _logprobs(self, token_ids: list[int], steps: SampleLogprobs | None,
                  num: int | None) -> ChatLogprobs | None:
        if num is None or steps is None:
            return None
        content = []
        for token_id, step in zip(token_ids, steps):
            text = token_text(self.tokenizer, token_id, step[token_id])
            tops = [_top(token_text(self.tokenizer, t, lp), clamp_logprob(lp.logprob))
                    for t, lp in top_entries(step, num)]
            content.append(ChatTokenLogprob(text, clamp_logprob(step[token_id].logprob),
                                            list(text.encode()), tops))
        return ChatLogprobs(content)

    async def _stream(self, request: ChatCompletionRequest, outputs: AsyncIterator,
                      request_id: str, model: str, num_logprobs: int | None,
                      include_usage: bool):
        created = int(time.time())

        def chunk(choices, usage_info=None) -> bytes:
            return sse(_ENCODER, ChatCompletionChunk(request_id, model, choices, usage_info,
                                                     created=created))

        tracker, final = DeltaTracker(num_logprobs is not None), None
        try:
            for index in range(request.n):
                yield chunk([ChatStreamChoice(index, DeltaMessage(role="assistant", content=""))])
            async for _, output in outputs:
                for c in output.outputs:
                    delta = tracker.delta(c.index, c)
                    if delta is None:
                        continue
                    logprobs = self._logprobs(delta.token_ids, delta.logprobs or None,
                                              num_logprobs)
                    yield chunk([ChatStreamChoice(c.index, DeltaMessage(content=delta.text),
                                                  logprobs, c.finish_reason, c.stop_reason)])
                final = output
            if include_usage:
                yield chunk([], usage([final]))
        except Exception as error:  # noqa: BLE001 - the engine died mid-stream; tell the client
            yield stream_error(error)
        finally:
            await outputs.aclose()
        yield SSE_DONE


def _num_logprobs(request: ChatCompletionRequest) -> int | None:
    if request.top_logprobs is not None:
        if not request.logprobs:
            raise OpenAIError("when using `top_logprobs`, `logprobs` must be set to true.",
                              param="top_logprobs")
        if not 0 <= request.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                              f"{request.top_logprobs}.", param="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(text, logprob, list(text.encode()))
