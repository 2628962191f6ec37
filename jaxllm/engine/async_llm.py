"""AsyncLLM: an EngineCore stepped by one background thread, fed and drained from asyncio.

The engine is not thread-safe, so the loop thread is the only one that touches it: requests and
aborts arrive through a locked inbox drained between steps, and outputs travel back to each
request's asyncio queue via `loop.call_soon_threadsafe`. When nothing is in flight the thread
sleeps on a condition variable (no busy spin).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Callable

from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# What clients hear; the cause goes to the log only.
_DEAD = "The engine loop stopped; the server is shutting down."


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue-len allows (the server answers 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop raised and stopped; no request can complete."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | BaseException

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shutting down): nobody listens
            pass


@dataclass
class _AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None
    stream: _Stream
    # None once added, or the ValueError from add_request; cancelled when the client left first
    accepted: concurrent.futures.Future
    cache_salt: str | None = None
    lora_request: object = None  # a jaxllm.lora.LoRARequest


@dataclass
class _CallCommand:
    """An EngineCore method the loop thread runs between steps (prefix cache reset, LoRA
    adapters in and out)."""
    method: Callable
    args: tuple
    done: concurrent.futures.Future  # its result, or its exception


class AsyncLLM:
    def __init__(self, engine_core, max_queue_len: int | None = None) -> None:
        self.core = engine_core
        self.tokenizer = engine_core.tokenizer
        self.max_model_len: int = engine_core.max_model_len
        self.model_name: str = engine_core.model_name
        self.vocab_size: int = engine_core.vocab_size
        self.max_queue_len = max_queue_len
        self._wakeup = threading.Condition()
        # adds, request ids to abort, calls
        self._inbox: deque[_AddCommand | str | _CallCommand] = deque()
        self._streams: dict[str, _Stream] = {}  # owned by the loop thread
        self._num_aborted = 0  # requests aborted while still running (client gone, or abort())
        self._stats: dict = {**engine_core.get_stats(), "num_aborted_total": 0}
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run_loop, name="jaxllm-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side -------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str, prompt: str | None = None,
                       cache_salt: str | None = None,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs until the request finishes.

        Validation errors (ValueError) and QueueFullError are raised by the first `__anext__`,
        before any output, so an HTTP handler can still answer 400/503. Closing or cancelling
        the iterator early aborts the request and frees its KV blocks.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_AddCommand(request_id, list(prompt_token_ids), sampling_params, prompt,
                                 stream, accepted, cache_salt, lora_request))
        finished = False
        try:
            await asyncio.wrap_future(accepted)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._inbox.append(request_id)
            self._wakeup.notify()

    async def reset_prefix_cache(self) -> bool:
        """EngineCore.reset_prefix_cache, run by the loop thread between steps."""
        return await self._call(self.core.reset_prefix_cache)

    async def add_lora(self, lora_request) -> bool:
        """Loads a LoRA adapter into host memory (EngineCore.add_lora); ValueError if bad."""
        return await self._call(self.core.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self._call(self.core.remove_lora, lora_int_id)

    async def _call(self, method: Callable, *args):
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._error is not None:
            raise EngineDeadError(f"The engine loop stopped: {self._error!r}")
        with self._wakeup:
            self._inbox.append(_CallCommand(method, args, done))
            self._wakeup.notify()
        return await asyncio.wrap_future(done)

    def get_stats(self) -> dict:
        """The engine's stats after its latest step (see EngineCore.get_stats), and
        num_aborted_total."""
        return self._stats

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop thread; raises EngineDeadError if it had died, so that a server
        process whose engine died exits non-zero and its supervisor restarts it."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join(timeout)
        if self._error is not None:
            raise EngineDeadError("The engine loop had stopped.") from self._error

    def _submit(self, command: _AddCommand) -> None:
        with self._wakeup:  # under the lock, so a dying loop fails every add it lets in
            if not self.is_healthy:
                raise EngineDeadError(_DEAD)
            if self.max_queue_len is not None:
                # Sequences, not requests: one request with n=128 queues 128 of them.
                num_queued = self._stats.get("num_waiting", 0) + sum(
                    c.sampling_params.n for c in self._inbox if isinstance(c, _AddCommand))
                if num_queued >= self.max_queue_len:
                    raise QueueFullError(
                        f"The server is at capacity: {num_queued} sequences are waiting "
                        f"(max_queue_len={self.max_queue_len}). Retry later.")
            self._inbox.append(command)
            self._wakeup.notify()

    # ---- loop thread --------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    return
                self._apply(commands)
                if self.core.has_unfinished_requests():
                    self._dispatch(self.core.step())
                self._stats = {**self.core.get_stats(),
                               "num_aborted_total": self._num_aborted}
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about it
            logger.exception("Engine loop crashed")
            self._error = error
            for stream in self._streams.values():
                stream.put(EngineDeadError(_DEAD))
            self._streams.clear()
            self._fail_inbox()

    def _wait_for_work(self) -> list[_AddCommand | str] | None:
        with self._wakeup:
            while not self._inbox and not self._stopping and not self.core.has_unfinished_requests():
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
            return commands

    def _apply(self, commands: list[_AddCommand | str]) -> None:
        for command in commands:
            if isinstance(command, str):
                if self._streams.pop(command, None) is not None:
                    self.core.abort_request([command])
                    self._num_aborted += 1
            elif isinstance(command, _CallCommand):
                try:
                    result = command.method(*command.args)
                except ValueError as error:  # a bad argument; the engine is fine
                    command.done.set_exception(error)
                else:
                    command.done.set_result(result)
            else:
                self._add(command)

    def _add(self, command: _AddCommand) -> None:
        """Adds the request unless its client already left (the future was cancelled). Once
        the future runs it can no longer be cancelled: a client leaving later sends an abort."""
        if not command.accepted.set_running_or_notify_cancel():
            return
        try:
            self.core.add_request(command.request_id, command.prompt_token_ids,
                                  command.sampling_params, prompt=command.prompt,
                                  cache_salt=command.cache_salt,
                                  lora_request=command.lora_request)
        except ValueError as error:
            command.accepted.set_exception(error)
            return
        except BaseException as error:  # the loop dies: this waiter, off the inbox, hears it
            self._error = error  # first, so that whoever hears of the death sees it unhealthy
            command.accepted.set_exception(EngineDeadError(_DEAD))
            raise
        self._streams[command.request_id] = command.stream
        command.accepted.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted while the step ran
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _fail_inbox(self) -> None:
        with self._wakeup:
            for command in self._inbox:
                if (isinstance(command, _AddCommand)
                        and command.accepted.set_running_or_notify_cancel()):
                    command.accepted.set_exception(EngineDeadError(_DEAD))
                elif isinstance(command, _CallCommand):
                    command.done.set_exception(EngineDeadError(_DEAD))
            self._inbox.clear()
