"""POST /v1/completions: prompts as strings or token ids, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.responses import Response, StreamingResponse

from jaxllm.outputs import RequestOutput, SampleLogprobs
from server.errors import OpenAIError
from server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                             CompletionRequest, CompletionResponse)
from server.serving import (SSE_DONE, DeltaTracker, OpenAIServing, sse, stream_error,
                            token_text, top_entries,
                            usage)

MAX_PROMPTS = 1024
_ENCODER = msgspec.json.Encoder()


class CompletionServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.tokenizer = serving.tokenizer

    async def create(self, request: CompletionRequest) -> Response:
        model = self.serving.check_model(request.model)
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported.", param="suffix")
        if request.echo and request.logprobs is not None:
            raise OpenAIError("echo with logprobs is not supported: the engine does not "
                              "compute prompt logprobs.", param="echo")
        prompts = self._prompts(request.prompt)
        longest = max(len(ids) for ids, _ in prompts)
        params = self.serving.sampling_params(request, request.max_tokens, longest,
                                              request.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = await self.serving.start(prompts, params, request_id)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._stream(request, prompts, outputs, request_id, model, include_usage),
                media_type="text/event-stream")
        finals = await _collect(outputs, len(prompts))
        choices = [self._choice(request, prompts[p][1], output, p)
                   for p, output in enumerate(finals)]
        body = CompletionResponse(request_id, model, [c for cs in choices for c in cs],
                                  usage=usage(finals))
        return Response(_ENCODER.encode(body), media_type="application/json")

    def _prompts(self, prompt) -> list[tuple[list[int], str]]:
        """[(token ids, text)], one per prompt; validates the union msgspec cannot express."""
        if isinstance(prompt, str):
            return [(self.tokenizer.encode(prompt), prompt)]
        if not prompt:
            raise OpenAIError("prompt cannot be empty.", param="prompt")
        if len(prompt) > MAX_PROMPTS:
            raise OpenAIError(f"At most {MAX_PROMPTS} prompts per request, got {len(prompt)}.",
                              param="prompt")
        kinds = {type(p) for p in prompt}
        if kinds == {int}:
            prompt = [prompt]
        elif kinds == {str}:
            return [(self.tokenizer.encode(p), p) for p in prompt]
        elif kinds != {list}:
            raise OpenAIError("prompt must be a string, a list of strings, a list of token ids "
                              "or a list of token-id lists.", param="prompt")
        if any(not ids for ids in prompt):
            raise OpenAIError("prompt cannot be empty.", param="prompt")
        return [(ids, self._decode_prompt(ids)) for ids in prompt]

    def _decode_prompt(self, ids: list[int]) -> str:
        if any(not 0 <= t < len(self.tokenizer) for t in ids):
            bad = next(t for t in ids if not 0 <= t < len(self.tokenizer))
            raise OpenAIError(f"Token id {bad} is out of vocabulary (vocab size "
                              f"{len(self.tokenizer)}).", param="prompt")
        return self.tokenizer.decode(ids)

    def _choice(self, request: CompletionRequest, prompt_text: str, output: RequestOutput,
                prompt_index: int) -> list[CompletionChoice]:
        prefix = prompt_text if request.echo else ""
        return [CompletionChoice(
            index=prompt_index * request.n + c.index, text=prefix + c.text,
            logprobs=self._logprobs(c.token_ids, c.logprobs, request.logprobs, len(prefix)),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in output.outputs]

    def _logprobs(self, token_ids: list[int], steps: SampleLogprobs | None, num: int | None,
                  offset: int) -> CompletionLogprobs | None:
        if num is None or steps is None:
            return None
        result = CompletionLogprobs()
        for token_id, step in zip(token_ids, steps):
            text = token_text(self.tokenizer, token_id, step[token_id])
            result.tokens.append(text)
            result.token_logprobs.append(step[token_id].logprob)
            result.top_logprobs.append({token_text(self.tokenizer, t, lp): lp.logprob
                                        for t, lp in top_entries(step, num)})
            result.text_offset.append(offset)
            offset += len(text)
        return result

    async def _stream(self, request: CompletionRequest, prompts, outputs: AsyncIterator,
                      request_id: str, model: str, include_usage: bool):
        tracker, finals, offsets = DeltaTracker(request.logprobs is not None), {}, {}
        created = int(time.time())
        try:
            async for prompt_index, output in outputs:
                for c in output.outputs:
                    index = prompt_index * request.n + c.index
                    delta = tracker.delta(index, c)
                    if delta is None:
                        continue
                    prefix = prompts[prompt_index][1] if request.echo and delta.first else ""
                    offset = offsets.get(index, 0) + len(prefix)
                    logprobs = self._logprobs(delta.token_ids, delta.logprobs or None,
                                              request.logprobs, offset)
                    offsets[index] = offset + len(delta.text)
                    choice = CompletionChoice(index, prefix + delta.text, logprobs,
                                              c.finish_reason, c.stop_reason)
                    yield sse(_ENCODER, CompletionChunk(request_id, model, [choice],
                                                        created=created))
                if output.finished:
                    finals[prompt_index] = output
            if include_usage:
                yield sse(_ENCODER, CompletionChunk(request_id, model, [], created=created,
                                                    usage=usage(list(finals.values()))))
        except Exception as error:  # noqa: BLE001 - the engine died mid-stream; tell the client
            yield stream_error(error)
        finally:
            await outputs.aclose()
        yield SSE_DONE


async def _collect(outputs: AsyncIterator, num_prompts: int) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * num_prompts
    try:
        async for prompt_index, output in outputs:
            if output.finished:
                finals[prompt_index] = output
    finally:
        await outputs.aclose()
    return finals
