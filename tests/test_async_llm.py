"""AsyncLLM against a scripted engine core (no model): clients that leave before their request
is accepted, a loop that dies, and the queue limit counted in sequences."""

from __future__ import annotations

import asyncio
import threading

import pytest

from jaxllm.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams


class ScriptedCore:
    """Finishes every request after one step; `step` blocks while `gate` is clear, and raises
    `fail` when set."""

    tokenizer, max_model_len, model_name, vocab_size = None, 64, "scripted", 100

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()
        self.fail: BaseException | None = None
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.pending: list[str] = []

    def get_stats(self) -> dict:
        return {"num_waiting": 0}

    def add_request(self, request_id, prompt_token_ids, sampling_params, prompt=None,
                    cache_salt=None, lora_request=None) -> None:
        self.added.append(request_id)
        self.pending.append(request_id)

    def abort_request(self, request_ids) -> None:
        self.aborted += request_ids
        self.pending = [r for r in self.pending if r not in request_ids]

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[RequestOutput]:
        self.in_step.set()
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        done, self.pending = self.pending, []
        return [RequestOutput(r, None, [1], [CompletionOutput(0, "", [7], finish_reason="length")],
                              finished=True) for r in done]


async def collect(engine: AsyncLLM, request_id: str, n: int = 1) -> list[RequestOutput]:
    return [o async for o in engine.generate([1, 2], SamplingParams(n=n), request_id)]


def test_a_request_cancelled_before_acceptance_is_dropped_and_the_loop_goes_on():
    core = ScriptedCore()
    engine = AsyncLLM(core)

    async def scenario() -> None:
        await collect(engine, "busy")  # ensure the loop runs
        core.gate.clear()
        core.in_step.clear()
        blocker = asyncio.create_task(collect(engine, "blocker"))
        await asyncio.to_thread(core.in_step.wait)  # the loop thread is inside step()
        leaver = asyncio.create_task(collect(engine, "leaver"))
        await asyncio.sleep(0.05)  # its add waits in the inbox
        leaver.cancel()
        await asyncio.sleep(0.05)
        core.gate.set()
        await blocker
        assert (await collect(engine, "after"))[-1].finished

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert engine.is_healthy
    assert "leaver" not in core.added and core.pending == []
    engine.shutdown()


def test_a_dead_loop_fails_waiters_and_shutdown_raises():
    core = ScriptedCore()
    engine = AsyncLLM(core)
    core.fail = RuntimeError("device lost at 0xdeadbeef")

    async def scenario() -> None:
        with pytest.raises(EngineDeadError) as info:
            await collect(engine, "victim")
        assert "0xdeadbeef" not in str(info.value)  # the cause goes to the log only
        with pytest.raises(EngineDeadError):
            await collect(engine, "late")

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert not engine.is_healthy
    with pytest.raises(EngineDeadError):
        engine.shutdown()


def test_the_queue_limit_counts_sequences():
    core = ScriptedCore()
    engine = AsyncLLM(core, max_queue_len=4)

    async def scenario() -> None:
        core.gate.clear()
        core.in_step.clear()
        first = asyncio.create_task(collect(engine, "first"))
        await asyncio.to_thread(core.in_step.wait)
        queued = asyncio.create_task(collect(engine, "n3", n=3))
        queued_too = asyncio.create_task(collect(engine, "n3b", n=3))  # 3 < 4 were waiting
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="6 sequences"):
            await collect(engine, "refused")
        core.gate.set()
        await asyncio.gather(first, queued, queued_too)

    asyncio.run(asyncio.wait_for(scenario(), 10))
    engine.shutdown()


def test_an_add_that_kills_the_loop_fails_its_own_waiter():
    """The request being added when the loop dies is off the inbox already: it must hear of the
    death too, not wait forever."""
    core = ScriptedCore()
    core.add_request = lambda *args, **kwargs: 1 / 0
    engine = AsyncLLM(core)

    async def scenario() -> None:
        with pytest.raises(EngineDeadError):
            await collect(engine, "fatal")

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert not engine.is_healthy
