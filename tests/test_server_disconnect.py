"""Clients that give up at any moment (before their request is accepted, while it waits, mid-
prefill, mid-stream) while a long prefill keeps the engine thread busy: the engine must go on,
abort what they left and free every KV block."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from conftest import TINY_CONFIGS, build_tiny_tokenizer, save_random_checkpoint
from jaxllm.server.testing import RemoteServer

# Wide enough that a 256-token prefill step takes tens to hundreds of ms on a CPU: requests then
# wait in the engine's inbox for a step to end, which is when a leaving client used to kill it.
WIDE_LLAMA = dict(TINY_CONFIGS["llama"], hidden_size=256, intermediate_size=1024,
                  num_hidden_layers=4, max_position_embeddings=2048)
_WORDS = "fox dog paged blocks keys values hello world kernels".split()
SERVER_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
               "--block-size", "16", "--num-gpu-blocks-override", "640", "--enforce-eager"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = save_random_checkpoint(WIDE_LLAMA, str(tmp_path_factory.mktemp("wide_llama")),
                                       build_tiny_tokenizer(), seed=4)
    cache = str(tmp_path_factory.mktemp("jit"))
    remote = RemoteServer(model_dir, SERVER_ARGS + ["--compilation-cache-dir", cache])
    yield remote
    remote.close()



def impatient_body(rng: random.Random) -> tuple[str, dict]:
    """A completion or chat, streamed or not, with a prompt long enough to need prefill steps."""
    stream = rng.random() < 0.5
    if rng.random() < 0.3:
        words = " ".join(rng.choice(_WORDS) for _ in range(200))
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": words}],
                                        "max_tokens": 32, "stream": stream, "ignore_eos": True}
    prompt = [rng.randrange(3, 370) for _ in range(rng.randint(64, 1000))]
    return "/v1/completions", {"prompt": prompt, "max_tokens": 32, "n": rng.randint(1, 3),
                               "stream": stream, "ignore_eos": True}


async def give_up(http: httpx.AsyncClient, path: str, body: dict, patience: float) -> str:
    try:
        async with asyncio.timeout(patience):
            async with http.stream("POST", path, json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
                return f"done {response.status_code}"
    except TimeoutError:
        return "gave up"


def test_clients_that_give_up_during_a_long_prefill_leave_the_engine_healthy(server):
    idle = server.wait_idle(60.0)
    rng = random.Random(0)
    long_prompt = " ".join(rng.choice(_WORDS) for _ in range(560))
    num_tokens = httpx.post(server.url + "/tokenize", json={"prompt": long_prompt}).json()["count"]
    assert 1500 < num_tokens < 2040, num_tokens  # about eight prefill steps

    async def scenario() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            results = []
            for _ in range(3):  # each wave: one long prefill, impatient clients meanwhile
                long_prefill = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": long_prompt, "max_tokens": 4, "ignore_eos": True}))
                clients = []
                for _ in range(12):
                    await asyncio.sleep(rng.uniform(0.02, 0.12))
                    clients.append(asyncio.create_task(
                        give_up(http, *impatient_body(rng), rng.uniform(0.05, 0.3))))
                results += await asyncio.gather(*clients)
                response = await long_prefill
                results.append(f"long {response.status_code}")
            return results

    results = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
    assert httpx.get(server.url + "/health").status_code == 200, server.log_tail()
    assert results.count("gave up") >= 18, results  # most clients left early
    assert all(r in ("gave up", "done 200", "long 200") for r in results), results
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    freed = server.wait_idle(60.0)
    assert freed["jaxllm:num_free_blocks"] == idle["jaxllm:num_free_blocks"]
    assert server.proc.poll() is None


def test_a_token_id_prompt_longer_than_1024_is_one_prompt(server):
    prompt = random.Random(1).choices(range(3, 370), k=1500)
    response = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 2
