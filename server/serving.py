"""What both generation endpoints share: model check, sampling params, length checks, streams."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus

import msgspec

from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from jaxllm.engine.input_processor import InputProcessor, ProcessedPrompt
from jaxllm.lora.request import LoRARequest
from jaxllm.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobs
from jaxllm.sampling_params import SamplingParams
from jaxllm.server.errors import INTERNAL_ERROR, OpenAIError, error_body
from jaxllm.server.lora_models import LoRAModulePath, ServedAdapters
from jaxllm.server.metrics import RequestTimer, ServerMetrics
from jaxllm.server.protocol import (LoadLoRAAdapterRequest, LogprobEntry, ModelCard, ModelList,
                                   PromptLogprobs, PromptTokenUsageInfo, SamplingFields,
                                   UnloadLoRAAdapterRequest, UsageInfo, unsupported_field)

logger = logging.getLogger(__name__)
_ENCODER = msgspec.json.Encoder()

# OpenAI's JSON stand-in for -inf.
MIN_LOGPROB = -9999.0
# A request fans out into prompts x n sequences; past these the server would only queue itself
# to death (vLLM has no such caps; its clients never need more).
MAX_N = 128
MAX_SEQUENCES_PER_REQUEST = 1024
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], metrics: ServerMetrics,
                 chat_template: str | None = None,
                 adapters: ServedAdapters | None = None) -> None:
        """adapters: the LoRA adapters served by name (LoRA enabled), else None."""
        self.engine = engine
        # The engine thread detokenizes with its tokenizer; the event loop (token texts) and
        # the input thread (prompts) each get their own copy.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.processor = InputProcessor(copy.deepcopy(engine.tokenizer), engine.max_model_len,
                                        engine.vocab_size, chat_template)
        # Tokenising and templating run here, never on the event loop: a long prompt must not
        # stall /health or the streams. One thread: prompts are bounded by the body limit.
        self._input_thread = ThreadPoolExecutor(1, thread_name_prefix="jaxllm-input")
        self.max_model_len = engine.max_model_len
        self.served_model_names = served_model_names
        self.metrics = metrics
        self.adapters = adapters

    async def off_loop(self, fn, *args):
        """`fn(*args)` on the input thread (an InputError it raises becomes a 400)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._input_thread, functools.partial(fn, *args))

    def models(self) -> ModelList:
        root = self.served_model_names[0]
        adapters = self.adapters.requests.values() if self.adapters else ()
        return ModelList([ModelCard(id=name, max_model_len=self.max_model_len, root=root)
                          for name in self.served_model_names]
                         + [ModelCard(id=a.lora_name, max_model_len=self.max_model_len,
                                      root=a.lora_path, parent=a.base_model_name or root)
                            for a in adapters])

    def model(self, model_id: str) -> ModelCard:
        """One served model's card (GET /v1/models/{id}), or OpenAI's 404."""
        card = next((c for c in self.models().data if c.id == model_id), None)
        if card is None:
            raise OpenAIError(f"The model `{model_id}` does not exist.", HTTPStatus.NOT_FOUND,
                              "model")
        return card

    def tokenizer_info(self) -> dict:
        """What a client needs to tokenise as the server does (vLLM's /tokenizer_info)."""
        tokenizer = self.require_tokenizer()
        special = {name: getattr(tokenizer, name, None)
                   for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return {"tokenizer_class": type(tokenizer).__name__, **special,
                "chat_template": self.chat_template or getattr(tokenizer, "chat_template", None),
                "model_max_length": self.max_model_len, "vocab_size": len(tokenizer)}

    def require_tokenizer(self, param: str | None = None):
        """The tokenizer; 400 on a server started without one (dummy presets)."""
        return self.processor.require_tokenizer(param)

    def check_model(self, model: str | None) -> str:
        """The name responses report: the base model's first name, or the adapter's."""
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        if self.lora_for(model) is not None:
            return model
        raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's model field names, if it names one."""
        return None if self.adapters is None else self.adapters.requests.get(model)

    # -- LoRA adapters at runtime (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -----
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        if self.adapters is None:
            raise OpenAIError("LoRA is not enabled: start the server with --enable-lora.")
        if not body.lora_name or not body.lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.")
        lora_request = self.adapters.new_request(LoRAModulePath(body.lora_name, body.lora_path))
        try:
            await self.engine.add_lora(lora_request)
        except ValueError as error:
            raise OpenAIError(str(error), param="lora_path") from None
        self.adapters.add(lora_request)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        if self.adapters is None:
            raise OpenAIError("LoRA is not enabled: start the server with --enable-lora.")
        if not body.lora_name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.")
        lora_request = self.adapters.pop(body.lora_name)
        await self.engine.remove_lora(lora_request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    # -- sampling -------------------------------------------------------------------------------
    def sampling_params(self, request: SamplingFields, max_tokens: int | None, prompt_len: int,
                        logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams, after `check_request` and the prompt's processing."""
        self.processor.check_context(prompt_len, max_tokens)
        stop = [request.stop] if isinstance(request.stop, str) else request.stop
        try:
            return SamplingParams(
                n=request.n,
                temperature=_default(request.temperature, 1.0),
                top_p=_default(request.top_p, 1.0),
                # Past the vocabulary top-k keeps everything; the sampler holds it in int32.
                top_k=min(_default(request.top_k, 0), self.engine.vocab_size),
                min_p=_default(request.min_p, 0.0),
                presence_penalty=_default(request.presence_penalty, 0.0),
                frequency_penalty=_default(request.frequency_penalty, 0.0),
                repetition_penalty=_default(request.repetition_penalty, 1.0),
                seed=request.seed,
                max_tokens=self.max_model_len - prompt_len if max_tokens is None else max_tokens,
                min_tokens=request.min_tokens,
                stop=stop,
                stop_token_ids=request.stop_token_ids,
                include_stop_str_in_output=request.include_stop_str_in_output,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens)
        except ValueError as error:
            raise OpenAIError(str(error)) from None

    def check_request(self, request: SamplingFields, num_prompts: int) -> None:
        """The bounds and unsupported fields that SamplingParams does not check; before any
        work on the prompts."""
        field = unsupported_field(request)
        if field is not None:
            raise OpenAIError(f"`{field}` is not supported by this server.", param=field)
        if request.prompt_logprobs is not None and request.stream:
            raise OpenAIError("`prompt_logprobs` are not available when `stream=True`.",
                              param="prompt_logprobs")
        if not 1 <= request.n <= MAX_N:
            raise OpenAIError(f"n must be in [1, {MAX_N}], got {request.n}.", param="n")
        if num_prompts * request.n > MAX_SEQUENCES_PER_REQUEST:
            raise OpenAIError(
                f"A request may ask for at most {MAX_SEQUENCES_PER_REQUEST} sequences (prompts "
                f"x n), got {num_prompts} x {request.n}.", param="n")
        bad_ids = [t for t in request.stop_token_ids or () if not 0 <= t < self.engine.vocab_size]
        if bad_ids:
            raise OpenAIError(f"stop_token_ids must be in [0, {self.engine.vocab_size}), got "
                              f"{bad_ids[0]}.", param="stop_token_ids")
        self._check_stop(request.stop)

    def _check_stop(self, stop: str | list[str] | None) -> None:
        stop = [stop] if isinstance(stop, str) else stop or []
        if len(stop) > MAX_STOP_STRINGS:
            raise OpenAIError(f"stop may hold at most {MAX_STOP_STRINGS} strings, "
                              f"got {len(stop)}.", param="stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise OpenAIError(f"A stop string may be at most {MAX_STOP_STRING_CHARS} characters "
                              f"long.", param="stop")
        if stop:  # stop strings are found in detokenised text
            self.require_tokenizer("stop")

    # -- streams --------------------------------------------------------------------------------
    async def start(self, prompts: list[ProcessedPrompt], params: SamplingParams,
                    request_id: str, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None,
                    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submits every prompt; returns once all were accepted (errors become 4xx/503 here).

        The returned iterator yields (prompt index, cumulative output) and records latency
        metrics; closing it early aborts whatever is unfinished.
        """
        timers = [self.metrics.timer(params) for _ in prompts]
        if cache_salt is not None and not cache_salt:
            raise OpenAIError("Parameter 'cache_salt' must be a non-empty string if provided.",
                              param="cache_salt")
        streams = [self.engine.generate(p.token_ids, params, f"{request_id}-{i}", prompt=p.text,
                                        cache_salt=cache_salt, lora_request=lora_request)
                   for i, p in enumerate(prompts)]
        firsts = await asyncio.gather(*(anext(s, None) for s in streams), return_exceptions=True)
        error = next((f for f in firsts if isinstance(f, BaseException)), None)
        if error is not None:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            raise _as_openai_error(error)
        return _timed(_merge(firsts, streams), timers)


async def _timed(outputs: AsyncIterator[tuple[int, RequestOutput]], timers: list[RequestTimer]):
    try:
        async for index, output in outputs:
            timers[index].on_output(output)
            yield index, output
    finally:
        await outputs.aclose()


async def _merge(firsts: list, streams: list[AsyncIterator]):
    """Interleaves several engine streams, each already advanced by one item (`firsts`)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(index: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                queue.put_nowait((index, item))
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, error))
        finally:
            queue.put_nowait((index, done))

    for index, first in enumerate(firsts):
        if first is not None:
            queue.put_nowait((index, first))
    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _as_openai_error(error: BaseException) -> BaseException:
    if isinstance(error, ValueError):
        return OpenAIError(str(error), param=getattr(error, "param", None))
    if isinstance(error, QueueFullError):
        return OpenAIError(str(error), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(error, EngineDeadError):
        return OpenAIError(str(error), HTTPStatus.SERVICE_UNAVAILABLE)
    return error


def _default(value, default):
    return default if value is None else value


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached_tokens = sum(o.num_cached_tokens or 0 for o in outputs)
    return UsageInfo(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                     PromptTokenUsageInfo(cached_tokens))


def top_entries(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The step's top-`num` alternatives by rank (the sampled token may rank anywhere)."""
    ranked = sorted(step.items(), key=lambda item: (item[1].rank or 0, -item[1].logprob))
    return [item for item in ranked if item[1].rank is not None and item[1].rank <= num][:num]


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: SampleLogprobs  # one dict per new token; [] when not asked
    first: bool  # the choice's first delta


class DeltaTracker:
    """Turns cumulative CompletionOutputs into per-choice deltas for streaming."""

    def __init__(self, every_token: bool) -> None:
        # Logprobs, token ids or no tokenizer: a token without text still makes a delta.
        self.every_token = every_token
        self.text_len: dict[int, int] = {}
        self.num_tokens: dict[int, int] = {}
        self.finished: set[int] = set()

    def delta(self, index: int, completion: CompletionOutput) -> Delta | None:
        """What is new in `completion` since the last call for `index`; None when nothing is."""
        if index in self.finished:
            return None
        first = index not in self.num_tokens
        start_text, start_token = self.text_len.get(index, 0), self.num_tokens.get(index, 0)
        text = completion.text[start_text:]
        num_new = len(completion.token_ids) - start_token
        if not text and completion.finish_reason is None and (
                num_new <= 0 or not self.every_token):
            return None
        self.text_len[index] = max(start_text, len(completion.text))
        self.num_tokens[index] = len(completion.token_ids)
        if completion.finish_reason is not None:
            self.finished.add(index)
        # The engine thread appends to `logprobs` while we read: slice by the token snapshot.
        end = len(completion.token_ids)
        logprobs = (completion.logprobs or [])[start_token:end]
        return Delta(text, completion.token_ids[start_token:end], logprobs, first)


def token_text(tokenizer, token_id: int, logprob: Logprob | None) -> str:
    """The token as text; vLLM's `token_id:N` form without a tokenizer."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def prompt_logprobs_body(steps: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """The engine's prompt logprobs as vLLM returns them (-inf clamped to -9999)."""
    if steps is None:
        return None
    return [None if step is None else
            {t: LogprobEntry(clamp_logprob(lp.logprob), lp.rank, lp.decoded_token)
             for t, lp in step.items()} for step in steps]


def sse(encoder, chunk) -> bytes:
    return b"data: " + encoder.encode(chunk) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def stream_error(error: Exception) -> bytes:
    """An error after the 200 went out: an SSE event with OpenAI's error body; only our own
    errors' messages reach the client, anything else stays in the log."""
    if isinstance(error, (OpenAIError, EngineDeadError)):
        logger.error("Stream failed: %s", error)
        return sse(_ENCODER, error_body(str(error), getattr(
            error, "status", HTTPStatus.SERVICE_UNAVAILABLE)))
    logger.exception("Stream failed", exc_info=error)
    return sse(_ENCODER, error_body(INTERNAL_ERROR, HTTPStatus.INTERNAL_SERVER_ERROR))
