"""The OpenAI-compatible server as users meet it: a real `python -m jaxllm.server` process on loopback,
driven by the official openai client (and raw httpx where the client hides the wire)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import numpy as np
import openai
import pytest

from conftest import TINY_CONFIGS, TINY_VOCAB
from jaxllm.server.testing import RemoteServer

API_KEY = "test-key-5e3a"
SERVER_ARGS = ["--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
               "--num-gpu-blocks-override", "64", "--block-size", "8",
               "--served-model-name", "tiny", "--max-queue-len", "256"]
ENGINE_KWARGS = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                     num_gpu_blocks_override=64, block_size=8)
_WORDS = ("fox jumps over the lazy dog paged attention keys values blocks tokens hello world "
          "compiles numerical programs kernels").split()


def word_prompts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 9))) for _ in range(count)]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("jit"))
    remote = RemoteServer(tiny_llama_dir, SERVER_ARGS + ["--compilation-cache-dir", cache],
                          api_key=API_KEY)
    yield remote
    remote.close()


@pytest.fixture(scope="module")
def client(server):
    return server.client()



def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_completion_stream_matches_non_stream(client):
    prompt = "the lazy dog compiles"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_n_logprobs_and_token_prompts(client):
    response = client.completions.create(model="tiny", prompt=[[5, 17, 33, 40], [9, 12]],
                                         n=3, max_tokens=6, temperature=1.0, seed=7, logprobs=3,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == list(range(6))
    assert response.usage.completion_tokens == 36
    for choice in response.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(v <= 0 for v in lp.token_logprobs)
        for top in lp.top_logprobs:
            assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())
    # Seeded sampling repeats itself.
    again = client.completions.create(model="tiny", prompt=[[5, 17, 33, 40], [9, 12]], n=3,
                                      max_tokens=6, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in response.choices]


def test_completion_stop_string_and_echo(client):
    prompt = "hello world kernels"
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    expected = text[:text.index(stop)]
    for stream in (False, True):
        result = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                           temperature=0, stop=[stop], stream=stream)
        if stream:
            chunks = [c.choices[0] for c in result if c.choices]
            got, finish = "".join(c.text for c in chunks), chunks[-1].finish_reason
        else:
            got, finish = result.choices[0].text, result.choices[0].finish_reason
        assert (got, finish) == (expected, "stop")
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                       echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt + text


def test_chat_matches_completion_of_template(server, client):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello world"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    reference = client.completions.create(model="tiny", prompt=tokens, max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model="tiny", messages=messages,
                                          max_completion_tokens=10, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content == reference.choices[0].text
    assert chat.usage.prompt_tokens == len(tokens) and chat.usage.completion_tokens == 10
    content = chat.choices[0].logprobs.content
    assert len(content) == 10
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    # Greedy: the chosen token is the top-1 alternative.
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5) for t in content)

    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True, n=2,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    for index in range(2):
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(d.delta.content or "" for d in deltas) == message.content
        assert deltas[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 20


def test_64_concurrent_streams_match_offline_greedy(server, tiny_llama_dir):
    from jaxllm import LLM, SamplingParams

    prompts = word_prompts(0, 64)
    max_tokens = 8
    llm = LLM(tiny_llama_dir, enforce_eager=True, compilation_cache_dir=None, **ENGINE_KWARGS)
    offline = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)]
    del llm

    async def stream_one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                                 max_tokens=max_tokens, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        client = server.async_client()
        return await asyncio.wait_for(
            asyncio.gather(*(stream_one(client, p) for p in prompts)), timeout=300)

    assert asyncio.run(run_all()) == offline
    metrics = server.wait_idle(20.0)
    assert metrics["jaxllm:e2e_request_latency_seconds_count"] >= 64
    assert metrics["jaxllm:time_to_first_token_seconds_count"] >= 64
    assert metrics["jaxllm:generation_tokens_total"] >= 64 * max_tokens


def test_disconnect_mid_stream_frees_blocks(server):
    idle = server.wait_idle(20.0)
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 110,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body,
                         headers=server.headers) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    busy = server.metrics()  # still connected: ~110 tokens to go
                    break  # leaving iter_lines closes the connection
    assert busy["jaxllm:num_requests_running"] == 1
    assert busy["jaxllm:kv_cache_usage_perc"] > 0
    assert busy["jaxllm:num_free_blocks"] < idle["jaxllm:num_free_blocks"]
    freed = server.wait_idle(10)
    assert freed["jaxllm:num_free_blocks"] == idle["jaxllm:num_free_blocks"]
    # ... because the engine aborted the request (an abort after the end is not counted).
    aborted = "jaxllm:num_requests_aborted_total"
    assert freed[aborted] == idle[aborted] + 1


def test_auth(server):
    url = server.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    wrong = httpx.get(url, headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
    assert httpx.get(url, headers=server.headers).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope",
                      max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # not under /v1


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "JSON"),
    (b'{"prompt": "hi", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"prompt": "hi", "n": 0}', 400, "n must be"),
    (b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    (b'{"prompt": "hi", "logprobs": 21}', 400, "logprobs"),
    (b'{"prompt": "hi", "max_tokens": 1000}', 400, "maximum context length is 128"),
    (b'{"prompt": [1, "a"]}', 400, "prompt"),
    (b'{"prompt": [999999]}', 400, "999999"),
    (b'{"prompt": "hi", "model": "gpt-4"}', 404, "gpt-4"),
])
def test_bad_completion_requests(server, body, status, needle):
    response = httpx.post(server.url + "/v1/completions", content=body, headers=server.headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["code"] == status and error["type"]


def test_prompt_too_long_names_numbers(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[7] * 120, max_tokens=16)
    message = info.value.body["message"]
    assert "128" in message and "136" in message and "120" in message and "16" in message


# -- prefix caching as the API reports it ------------------------------------------------------
BLOCK_SIZE = 8  # SERVER_ARGS' --block-size


def cached_tokens(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_completion_reports_cached_tokens_per_cache_salt(server, client):
    """A repeated prompt reads its full blocks from the cache (all but the last token's, which
    is always computed); a request under another salt reads none of them."""
    prompt = random.Random(1717).choices(range(3, 300), k=41)  # in no other test's cache
    hits = "jaxllm:prefix_cache_hits_total"
    hits_before = server.wait_idle(20.0)[hits]

    def complete(stream: bool = False, **extra):
        response = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=stream,
            stream_options={"include_usage": True} if stream else None, extra_body=extra)
        return list(response)[-1] if stream else response

    assert cached_tokens(complete()) == 0
    assert cached_tokens(complete()) == 40  # 5 full blocks
    assert cached_tokens(complete(stream=True)) == 40
    assert cached_tokens(complete(cache_salt="tenant-a")) == 0
    assert cached_tokens(complete(cache_salt="tenant-b")) == 0
    assert cached_tokens(complete(cache_salt="tenant-a")) == 40
    assert server.wait_idle(20.0)[hits] == hits_before + 3 * 40
    reset = httpx.post(server.url + "/reset_prefix_cache", headers=server.headers)
    assert reset.status_code == 200, reset.text
    assert cached_tokens(complete()) == 0


def test_chat_reports_cached_tokens_per_cache_salt(client):
    messages = [{"role": "system", "content": word_prompts(1717, 1)[0]},
                {"role": "user", "content": word_prompts(1718, 1)[0]}]

    def chat(stream: bool = False, **extra):
        response = client.chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=2, temperature=0,
            stream=stream, stream_options={"include_usage": True} if stream else None,
            extra_body=extra)
        return list(response)[-1] if stream else response

    # Salts no other request used: the chat template's opening is cached only under no salt.
    first = chat(cache_salt="chat-a")
    expected = (first.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert expected >= 2 * BLOCK_SIZE and cached_tokens(first) == 0
    assert cached_tokens(chat(cache_salt="chat-a")) == expected
    assert cached_tokens(chat(stream=True, cache_salt="chat-a")) == expected
    assert cached_tokens(chat(cache_salt="chat-b")) == 0
    chat()
    assert cached_tokens(chat()) == expected


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_empty_cache_salt_gets_400(server, path):
    base = ({"prompt": "hi"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    response = httpx.post(server.url + path, json={**base, "max_tokens": 2, "cache_salt": ""},
                          headers=server.headers)
    assert response.status_code == 400, response.text
    assert response.json() == {"error": {
        "message": "Parameter 'cache_salt' must be a non-empty string if provided.",
        "type": "BadRequestError", "param": "cache_salt", "code": 400}}
    wrong_type = httpx.post(server.url + path, json={**base, "cache_salt": 5},
                            headers=server.headers)
    assert wrong_type.status_code == 400 and "cache_salt" in wrong_type.json()["error"]["message"]


@pytest.fixture(scope="module")
def hf_log_softmax(tiny_llama_dir):
    """The reference: HF transformers' log_softmax over the next token at every position."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)

    def run(token_ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0], -1).numpy()
    return run


def assert_prompt_logprobs_match(prompt_logprobs, token_ids, reference, num_top):
    """vLLM's wire form: [null, {"token id": {logprob, rank, decoded_token}}, ...]."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(token_ids)
    for position in range(1, len(token_ids)):
        expected, token = reference[position - 1], token_ids[position]
        entry = prompt_logprobs[position]
        assert entry[str(token)]["logprob"] == pytest.approx(expected[token], abs=1e-4)
        assert entry[str(token)]["rank"] == int((expected >= expected[token]).sum())
        for top in np.argsort(-expected)[:num_top]:
            assert entry[str(top)]["logprob"] == pytest.approx(expected[top], abs=1e-4)


def test_echo_logprobs_cover_the_prompt(client, hf_log_softmax):
    prompt = random.Random(3).choices(range(3, 300), k=13)
    reference = hf_log_softmax(prompt)
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                       logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0,
                                       logprobs=2, echo=True,
                                       extra_body={"ignore_eos": True, "prompt_logprobs": 3})
    choice = echoed.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
    # The first prompt token has no context: null, as OpenAI and vLLM.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for position in range(1, len(prompt)):
        expected = reference[position - 1]
        assert lp.token_logprobs[position] == pytest.approx(expected[prompt[position]], abs=1e-4)
        # Keyed by text: byte tokens that decode alike ("\ufffd") share one key.
        top2 = np.sort(expected)[-2:]
        top = lp.top_logprobs[position]
        assert 1 <= len(top) <= 2
        assert all(np.abs(top2 - value).min() < 1e-4 for value in top.values())
    # The generated token: as the plain (non-echo) request reports it, and as HF ranks it first.
    assert lp.tokens[-1] == greedy.logprobs.tokens[0]
    assert lp.token_logprobs[-1] == pytest.approx(greedy.logprobs.token_logprobs[0], abs=1e-5)
    assert lp.token_logprobs[-1] == pytest.approx(reference[-1].max(), abs=1e-4)
    assert choice.text.endswith(greedy.text) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert_prompt_logprobs_match(choice.model_extra["prompt_logprobs"], prompt, reference, 3)

    # Streamed, the first chunk carries the prompt's logprobs.
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=2, echo=True,
        stream=True, extra_body={"ignore_eos": True}) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [t for c in chunks for t in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_chat_prompt_logprobs_match_hf(server, client, hf_log_softmax):
    messages = [{"role": "user", "content": "paged attention keys"}]
    tokens = httpx.post(server.url + "/tokenize", json={"messages": messages},
                        headers=server.headers).json()["tokens"]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 2})
    assert chat.usage.prompt_tokens == len(tokens)
    assert_prompt_logprobs_match(chat.model_extra["prompt_logprobs"], tokens,
                                 hf_log_softmax(tokens), 2)


@pytest.fixture(scope="module")
def dummy_server(tmp_path_factory):
    """A tiny Llama from a config.json alone: dummy weights and no tokenizer, as
    `jaxllm serve llama-3.1-8b --load-format dummy` runs."""
    from transformers import AutoConfig

    model_dir = str(tmp_path_factory.mktemp("tiny_dummy"))
    cfg = dict(TINY_CONFIGS["llama"])
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(model_dir)
    remote = RemoteServer(model_dir, ["--load-format", "dummy", *SERVER_ARGS[:-4]])
    yield remote, model_dir
    remote.close()


def test_token_ids_without_a_tokenizer(dummy_server):
    from jaxllm import LLM, SamplingParams

    server, model_dir = dummy_server
    client = server.client()
    prompts = [random.Random(seed).choices(range(TINY_VOCAB), k=9) for seed in range(2)]
    response = client.completions.create(model=model_dir, prompt=prompts, max_tokens=5,
                                         temperature=0, logprobs=1,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    llm = LLM(model_dir, load_format="dummy", enforce_eager=True, compilation_cache_dir=None,
              **ENGINE_KWARGS)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                           use_tqdm=False)
    del llm
    for choice, prompt, reference in zip(response.choices, prompts, offline):
        extra = choice.model_extra
        assert choice.text == "" and extra["prompt_token_ids"] == prompt
        assert extra["token_ids"] == reference.outputs[0].token_ids
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in extra["token_ids"]]
    assert response.usage.completion_tokens == 10

    for bad in ({"prompt": "hello"}, {"prompt": [[5, 6]], "stop": ["x"]}):
        with pytest.raises(openai.BadRequestError, match="without a tokenizer"):
            client.completions.create(model=model_dir, max_tokens=2, **bad)
    with pytest.raises(openai.BadRequestError, match="without a tokenizer"):
        client.chat.completions.create(model=model_dir, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 400 and "without a tokenizer" in response.text


def test_bench_serve_without_a_tokenizer(dummy_server):
    from jaxllm.bench.datasets import random_requests
    from jaxllm.bench.serve import benchmark

    server, model_dir = dummy_server
    requests = random_requests(6, 16, 5, vocab_size=TINY_VOCAB, seed=1)
    result = asyncio.run(benchmark(server.url, "/v1/completions", model_dir, requests,
                                   max_concurrency=3, ignore_eos=True, use_tqdm=False))
    assert (result["completed"], result["failed"]) == (6, 0), result["errors"]
    assert result["total_output_tokens"] == 30 and result["total_input_tokens"] == 96
    # Text is empty without a tokenizer, yet every token still streams as its own chunk.
    assert all(len(itl) == 4 for itl in result["itls"])
    assert 0 < result["mean_ttft_ms"] and 0 < result["mean_tpot_ms"] <= result["mean_e2el_ms"]


def test_serve_with_no_model_uses_the_default(default_model_dir):
    """`jaxllm serve` with no MODEL: the built-in SmolLM2-135M-Instruct answers a chat."""
    server = RemoteServer(None, ["--max-model-len", "128", "--max-num-seqs", "2",
                                 "--max-num-batched-tokens", "64", "--block-size", "16",
                                 "--num-gpu-blocks-override", "16"])
    try:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        chat = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
    finally:
        server.close()
    assert "Paris" in chat.choices[0].message.content, chat.choices[0].message.content


@pytest.mark.parametrize("path, extra, field", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a+"}, "guided_regex"),
    ("/v1/chat/completions", {"guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "user", "content": "hi"}]}, "messages.tool_calls"),
    ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_unsupported_fields_are_refused_by_name(server, path, extra, field):
    base = ({"prompt": "hi"} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    response = httpx.post(server.url + path, json={**base, "max_tokens": 2, **extra},
                          headers=server.headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"`{field}` is not supported" in error["message"]


def test_harmless_values_of_unsupported_fields_are_accepted(client):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        response_format={"type": "text"}, tool_choice="none", logit_bias={})
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2, best_of=1).choices


def test_echo_with_max_tokens_zero_scores_the_prompt(client, hf_log_softmax):
    """lm-eval's loglikelihood request: the prompt and its logprobs, nothing generated."""
    prompt = random.Random(5).choices(range(3, 300), k=11)
    reference = hf_log_softmax(prompt)
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                         logprobs=1, temperature=0)
    choice = response.choices[0]
    detokenized = httpx.post(str(client.base_url).replace("/v1/", "/detokenize"),
                             json={"tokens": prompt}).json()["prompt"]
    assert choice.text == detokenized and choice.finish_reason == "length"
    assert response.usage.completion_tokens == 0 and response.usage.prompt_tokens == len(prompt)
    lp = choice.logprobs
    assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(
        [reference[i - 1][prompt[i]] for i in range(1, len(prompt))], abs=1e-4)
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.logprobs.token_logprobs][1:] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-6)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=0)


@pytest.mark.parametrize("body, status, needle", [
    (b'{"prompt": "hi", "\xff\xfe": 1}', 400, "UTF-8"),
    (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested"),
    (b'{"prompt": "hi", "chat_template_kwargs": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, ""),
    (b'{"prompt": "hi", "stop": [' + b",".join([b'"s"'] * 65) + b"]}", 400, "at most 64"),
    (b'{"prompt": "hi", "stop": "' + b"s" * 1025 + b'"}', 400, "at most 1024 characters"),
    (b'{"prompt": [' + b",".join([b"[5]"] * 20) + b'], "n": 128}', 400, "20 x 128"),
    (b'{"prompt": [' + b",".join([b"5"] * 1100) + b"]}", 400, "length 1100"),
    (b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"prompt": "hi", "n": 129}', 400, "n must be"),
])
def test_hostile_bodies_get_400(server, body, status, needle):
    response = httpx.post(server.url + "/v1/completions", content=body, headers=server.headers,
                          timeout=30)
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert needle in error["message"] and error["code"] == status


def test_body_over_the_limit_gets_413(server):
    body = b'{"prompt": "' + b"a" * (32 * 1024 * 1024) + b'"}'
    response = httpx.post(server.url + "/tokenize", content=body, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


def test_health_answers_while_a_huge_prompt_arrives(server):
    """A 20 MB prompt is refused before tokenising, off the event loop; /health meanwhile."""
    huge = "hello world kernels " * 1_000_000

    async def scenario() -> tuple[list[float], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers=server.headers) as http:
            posts = [asyncio.create_task(http.post(path, json=body)) for path, body in (
                ("/v1/completions", {"prompt": huge, "max_tokens": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
                ("/tokenize", {"prompt": huge}))]
            latencies = []
            while not all(p.done() for p in posts):
                start = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)
            return latencies, [p.result() for p in posts]

    latencies, responses = asyncio.run(scenario())
    for response in responses:
        assert response.status_code == 400 and "maximum context length" in response.text
    assert max(latencies) < 2.0, latencies
