"""POST /v1/completions: prompts as strings or token ids, streamed or not."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.responses import Response, StreamingResponse

from jaxllm.engine.input_processor import InputError, ProcessedPrompt
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput
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
        self.serving.check_request(request, _num_prompts(request.prompt))
        prompts = await self.serving.off_loop(self._prompts, request.prompt)
        longest = max(len(p.token_ids) for p in prompts)
        # As vLLM: echo with logprobs needs the prompt's logprobs too.
        prompt_logprobs = (request.logprobs if request.prompt_logprobs is None and request.echo
                           else request.prompt_logprobs)
        # echo with max_tokens=0 scores the prompt (lm-eval's loglikelihood): the engine
        # generates one token, which the answer leaves out.
        echo_only = request.echo and request.max_tokens == 0
        params = self.serving.sampling_params(request, 1 if echo_only else request.max_tokens,
                                              longest, request.logprobs, prompt_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = await self.serving.start(prompts, params, request_id, request.cache_salt,
                                           self.serving.lora_for(request.model))
        if echo_only:
            outputs = _prompt_only(outputs)
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

    def _prompts(self, prompt) -> list[ProcessedPrompt]:
        """One ProcessedPrompt per prompt (runs on the input thread); validates the union
        msgspec cannot express. Without a tokenizer only token ids are accepted."""
        processor = self.serving.processor
        if isinstance(prompt, str):
            return [processor.from_text(prompt)]
        kinds = {type(p) for p in prompt}
        if not prompt or kinds == {int}:  # one prompt of token ids, however long
            return [processor.from_token_ids(prompt)]
        if kinds == {str}:
            return [processor.from_text(p) for p in prompt]
        if kinds != {list}:
            raise InputError("prompt must be a string, a list of strings, a list of token ids "
                             "or a list of token-id lists.", "prompt")
        return [processor.from_token_ids(ids) for ids in prompt]

    def _choice(self, request: CompletionRequest, prompt: ProcessedPrompt,
                output: RequestOutput, prompt_index: int) -> list[CompletionChoice]:
        prompt_ids, prompt_text = prompt.token_ids, prompt.text
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
                prompt_ids, prompt_text = (prompts[prompt_index].token_ids,
                                           prompts[prompt_index].text)
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


def _num_prompts(prompt) -> int:
    """How many prompts `prompt` holds (a flat list of token ids is one), bounded."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1  # a mixed list is refused on the input thread
    if len(prompt) > MAX_PROMPTS:
        raise OpenAIError(f"At most {MAX_PROMPTS} prompts per request, got {len(prompt)}.",
                          param="prompt")
    return len(prompt)


async def _prompt_only(outputs: AsyncIterator[tuple[int, RequestOutput]]):
    """The outputs with every generated token left out (echo with max_tokens=0)."""
    try:
        async for index, output in outputs:
            yield index, dataclasses.replace(output, outputs=[
                CompletionOutput(c.index, "", [], logprobs=None if c.logprobs is None else [],
                                 finish_reason=None if c.finish_reason is None else "length")
                for c in output.outputs])
    finally:
        await outputs.aclose()
