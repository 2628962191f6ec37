"""POST /v1/completions: prompts as strings or token ids, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.responses import Response, StreamingResponse

from jaxllm.outputs import Logprob, RequestOutput
from jaxllm.server.errors import OpenAIError
from jaxllm.server.protocol import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                             CompletionRequest, CompletionResponse)
from jaxllm.server.serving import (SSE_DONE, DeltaTracker, OpenAIServing, clamp_logprob,
                            prompt_logprobs_body, sse, stream_error, token_text, top_entries,
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
        prompts = self._prompts(request.prompt)
        longest = max(len(ids) for ids, _ in prompts)
        # As vLLM: echo with logprobs needs the prompt's logprobs too.
        prompt_logprobs = (request.logprobs if request.prompt_logprobs is None and request.echo
                           else request.prompt_logprobs)
        params = self.serving.sampling_params(request, request.max_tokens, longest,
                                              request.logprobs, prompt_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = await self.serving.start(prompts, params, request_id, request.cache_salt)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                self._stream(request, prompts, outputs, request_id, model, include_usage),
                media_type="text/event-stream")
        finals = await _collect(outputs, len(prompts))
        choices = [self._choice(request, prompts[p], output, p)
                   for p, output in enumerate(finals)]
        body = CompletionResponse(request_id, model, [c for cs in choices for c in cs],
                                  usage=usage(finals))
        return Response(_ENCODER.encode(body), media_type="application/json")

    def _prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """[(token ids, text)], one per prompt; validates the union msgspec cannot express.
        Without a tokenizer only token ids are accepted, and the text is None."""
        if isinstance(prompt, str):
            return [(self.serving.require_tokenizer("prompt").encode(prompt), prompt)]
        if not prompt:
            raise OpenAIError("prompt cannot be empty.", param="prompt")
        if len(prompt) > MAX_PROMPTS:
            raise OpenAIError(f"At most {MAX_PROMPTS} prompts per request, got {len(prompt)}.",
                              param="prompt")
        kinds = {type(p) for p in prompt}
        if kinds == {int}:
            prompt = [prompt]
        elif kinds == {str}:
            tokenizer = self.serving.require_tokenizer("prompt")
            return [(tokenizer.encode(p), p) for p in prompt]
        elif kinds != {list}:
            raise OpenAIError("prompt must be a string, a list of strings, a list of token ids "
                              "or a list of token-id lists.", param="prompt")
        if any(not ids for ids in prompt):
            raise OpenAIError("prompt cannot be empty.", param="prompt")
        return [(ids, self._decode_prompt(ids)) for ids in prompt]

    def _decode_prompt(self, ids: list[int]) -> str | None:
        vocab = self.serving.engine.vocab_size if self.tokenizer is None else len(self.tokenizer)
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(f"Token id {bad} is out of vocabulary (vocab size {vocab}).",
                              param="prompt")
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    def _choice(self, request: CompletionRequest, prompt: tuple[list[int], str | None],
                output: RequestOutput, prompt_index: int) -> list[CompletionChoice]:
        prompt_ids, prompt_text = prompt
        echo_ids, echo_steps = self._echo(request, prompt_ids, output)
        return [CompletionChoice(
            index=prompt_index * request.n + c.index,
            text=((prompt_text or "") if request.echo else "") + c.text,
            logprobs=self._logprobs(echo_ids + c.token_ids, echo_steps + (c.logprobs or []),
                                    request.logprobs, 0),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            prompt_logprobs=prompt_logprobs_body(output.prompt_logprobs),
            prompt_token_ids=prompt_ids if request.return_token_ids else None,
            token_ids=c.token_ids if request.return_token_ids else None)
            for c in output.outputs]

    @staticmethod
    def _echo(request: CompletionRequest, prompt_ids: list[int],
              output: RequestOutput) -> tuple[list[int], list]:
        """The prompt's tokens and logprob steps that lead the choice's logprobs under echo."""
        if not request.echo or request.logprobs is None:
            return [], []
        return prompt_ids, list(output.prompt_logprobs)

    def _logprobs(self, token_ids: list[int], steps: list[dict[int, Logprob] | None],
                  num: int | None, offset: int) -> CompletionLogprobs | None:
        """OpenAI's legacy logprobs; a step of None (the first prompt token) has null values."""
        if num is None:
            return None
        result = CompletionLogprobs()
        for token_id, step in zip(token_ids, steps):
            chosen = None if step is None else step[token_id]
            text = token_text(self.tokenizer, token_id, chosen)
            result.tokens.append(text)
            result.token_logprobs.append(None if chosen is None else clamp_logprob(chosen.logprob))
            result.top_logprobs.append(
                None if step is None else {token_text(self.tokenizer, t, lp): clamp_logprob(
                    lp.logprob) for t, lp in top_entries(step, num)})
            result.text_offset.append(offset)
            offset += len(text)
        return result

    async def _stream(self, request: CompletionRequest, prompts, outputs: AsyncIterator,
                      request_id: str, model: str, include_usage: bool):
        every_token = (request.logprobs is not None or request.return_token_ids
                       or self.tokenizer is None)
        tracker, finals, offsets = DeltaTracker(every_token), {}, {}
        created = int(time.time())
        try:
            async for prompt_index, output in outputs:
                prompt_ids, prompt_text = prompts[prompt_index]
                for c in output.outputs:
                    index = prompt_index * request.n + c.index
                    delta = tracker.delta(index, c)
                    if delta is None:
                        continue
                    echo = request.echo and delta.first
                    text = ((prompt_text or "") if echo else "") + delta.text
                    echo_ids, echo_steps = (self._echo(request, prompt_ids, output) if echo
                                            else ([], []))
                    offset = offsets.get(index, 0)
                    offsets[index] = offset + len(text)
                    logprobs = self._logprobs(echo_ids + delta.token_ids,
                                              echo_steps + delta.logprobs, request.logprobs,
                                              offset)
                    choice = CompletionChoice(
                        index, text, logprobs, c.finish_reason, c.stop_reason,
                        prompt_token_ids=(prompt_ids if request.return_token_ids and delta.first
                                          else None),
                        token_ids=delta.token_ids if request.return_token_ids else None)
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
