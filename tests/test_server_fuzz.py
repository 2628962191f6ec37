"""Hostile input: property-based malformed bodies get only 4xx (never 5xx) and the server keeps
serving without leaking KV blocks; past --max-queue-len requests get 503."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxllm.server.testing import RemoteServer

SERVER_ARGS = ["--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
               "--num-gpu-blocks-override", "32", "--block-size", "8", "--max-queue-len", "2"]
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
BASE_BODIES = {
    "/v1/completions": {"prompt": "hello world", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [5, 6]},
}
FIELDS = ["prompt", "messages", "model", "n", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
          "echo", "ignore_eos", "min_tokens", "stream", "stream_options", "tokens", "suffix",
          "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
          "prompt_logprobs", "return_token_ids"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10)


@st.composite
def hostile_requests(draw) -> tuple[str, bytes]:
    endpoint = draw(st.sampled_from(ENDPOINTS))
    kind = draw(st.sampled_from(["bytes", "json", "mutation"]))
    if kind == "bytes":
        return endpoint, draw(st.binary(max_size=64))
    if kind == "json":
        return endpoint, httpx.Request("POST", "/", json=draw(json_values)).content
    body = dict(BASE_BODIES[endpoint])
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS) | st.text(max_size=8))
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(json_values)
    return endpoint, httpx.Request("POST", "/", json=body).content


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("jit"))
    remote = RemoteServer(tiny_llama_dir, SERVER_ARGS + ["--compilation-cache-dir", cache])
    yield remote
    remote.close()


def wait_idle(server: RemoteServer, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics["jaxllm:num_requests_running"] == metrics["jaxllm:num_requests_waiting"] == 0:
            return metrics
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout} s: {server.metrics()}")


def test_malformed_bodies_get_4xx_and_server_keeps_serving(server):
    idle = wait_idle(server)
    statuses = []
    with httpx.Client(base_url=server.url, timeout=60) as http:

        @settings(max_examples=250, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(hostile_requests())
        def check(request):
            endpoint, body = request
            response = http.post(endpoint, content=body,
                                 headers={"Content-Type": "application/json"})
            statuses.append(response.status_code)
            assert response.status_code < 500, (endpoint, body, response.text)
            if response.status_code != 200:
                error = response.json()["error"]
                assert error["code"] == response.status_code and error["message"]

        check()
        assert statuses.count(400) > len(statuses) // 2  # the suite mostly probes bad input
        ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    freed = wait_idle(server)
    assert freed["jaxllm:num_free_blocks"] == idle["jaxllm:num_free_blocks"]
    assert freed["jaxllm:kv_cache_usage_perc"] == 0


def test_queue_full_gets_503_and_abort_frees_waiting_requests(server):
    idle = wait_idle(server)
    # 16 sequences on 2 slots: 14 wait, past --max-queue-len 2, for several seconds.
    big = {"prompt": "hello", "n": 16, "max_tokens": 50, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=big) as stream:
                assert stream.status_code == 200
                assert server.metrics()["jaxllm:num_requests_waiting"] >= 2
                rejected = await http.post("/v1/completions",
                                           json={"prompt": "hi", "max_tokens": 2})
                assert rejected.status_code == 503, rejected.text
                assert "max_queue_len=2" in rejected.json()["error"]["message"]
            # leaving the stream disconnects: all 16 sequences, waiting ones included, abort

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    freed = wait_idle(server, timeout=10)
    assert freed["jaxllm:num_free_blocks"] == idle["jaxllm:num_free_blocks"]
    assert (freed["jaxllm:num_requests_aborted_total"]
            == idle["jaxllm:num_requests_aborted_total"] + 1)
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_non_streaming_client_that_leaves_aborts_its_request(server):
    idle = wait_idle(server)
    # ~3800 steps on 2 slots: seconds even on a fast machine, far past the 0.5 s read timeout
    body = {"prompt": "hello", "n": 128, "max_tokens": 60, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body,
                   timeout=httpx.Timeout(60, read=0.5))
    freed = wait_idle(server, timeout=10)
    assert freed["jaxllm:num_free_blocks"] == idle["jaxllm:num_free_blocks"]
    assert (freed["jaxllm:num_requests_aborted_total"]
            == idle["jaxllm:num_requests_aborted_total"] + 1)
