"""/metrics: prometheus-client's exposition with vLLM's names, types and label sets (what vLLM's
Grafana dashboard queries), under vllm: and jaxllm:, and counts that follow real requests."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams
from jaxllm.server.metrics import ServerMetrics, build_1_2_5_buckets
from jaxllm.server.testing import RemoteServer

ENGINE_LABELS = {"model_name", "engine"}
# name -> prometheus type, as vLLM exposes them (vllm/v1/metrics/loggers.py).
VLLM_SERIES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge", "gpu_cache_usage_perc": "gauge",
    "num_preemptions": "counter", "prompt_tokens": "counter", "generation_tokens": "counter",
    "request_success": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "time_per_output_token_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_prefill_time_seconds": "histogram", "request_decode_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram", "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram", "request_max_num_generation_tokens": "histogram",
    "request_params_n": "histogram", "request_params_max_tokens": "histogram",
    "cache_config_info": "gauge",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
    "iteration_tokens_total": "histogram",
}
STATS = {"num_running": 1, "num_waiting": 2, "kv_cache_usage": 0.25, "num_free_blocks": 7,
         "num_preemptions_total": 3, "prompt_tokens_total": 11, "generation_tokens_total": 13,
         "num_aborted_total": 1, "prefix_cache_queries_total": 40, "prefix_cache_hits_total": 16,
         "iteration_tokens_counts": [0, 2, 0, 1] + [0] * 10, "iteration_tokens_sum": 30}
CACHE_INFO = {"block_size": 16, "num_gpu_blocks": 64, "gpu_memory_utilization": 0.9}


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape(metrics: ServerMetrics, stats: dict = STATS) -> dict:
    return families(metrics.render(stats).body.decode())


def value(found: dict, name: str, suffix: str = "", **labels) -> float:
    samples = [s for s in found[name].samples if s.name == name + suffix
               and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(samples) == 1, (name, suffix, labels, samples)
    return samples[0].value


def test_every_series_under_both_prefixes_with_vllms_labels():
    found = scrape(ServerMetrics("tiny", 128, CACHE_INFO))
    for prefix in ("vllm", "jaxllm"):
        for name, kind in VLLM_SERIES.items():
            family = found[f"{prefix}:{name}"]
            assert family.type == kind, name
            assert family.samples, name
            for sample in family.samples:
                if name == "cache_config_info":
                    assert sample.labels["engine"] == "0" and sample.value == 1
                    assert sample.labels["block_size"] == "16"
                    assert sample.labels["num_gpu_blocks"] == "64"
                    continue
                extra = {"finished_reason"} if name == "request_success" else set()
                assert set(sample.labels) - {"le"} == ENGINE_LABELS | extra, name
                assert sample.labels["model_name"] == "tiny"
    assert value(found, "vllm:kv_cache_usage_perc") == 0.25
    assert value(found, "vllm:gpu_cache_usage_perc") == 0.25
    assert value(found, "jaxllm:prompt_tokens", "_total") == 11
    assert value(found, "vllm:num_preemptions", "_total") == 3
    assert value(found, "jaxllm:prefix_cache_queries", "_total") == 40
    assert value(found, "vllm:prefix_cache_hits", "_total") == 16
    # Two steps of 2-8 tokens and one of 17-32: vLLM's buckets, cumulative.
    assert value(found, "vllm:iteration_tokens_total", "_bucket", le="8.0") == 2
    assert value(found, "vllm:iteration_tokens_total", "_bucket", le="32.0") == 3
    assert value(found, "vllm:iteration_tokens_total", "_count") == 3
    assert value(found, "vllm:iteration_tokens_total", "_sum") == 30
    reasons = {s.labels["finished_reason"] for s in found["vllm:request_success"].samples
               if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    assert any(name.startswith("process_") for name in found) or "python_info" in found


def test_one_prefix_only():
    found = scrape(ServerMetrics("tiny", prefix="vllm"))
    assert "vllm:prompt_tokens" in found
    assert not any(name.startswith("jaxllm:") for name in found)
    with pytest.raises(ValueError, match="metrics prefix"):
        ServerMetrics("tiny", prefix="prom")


def test_several_apps_in_one_process():
    first, second = ServerMetrics("a"), ServerMetrics("b")
    first.timer().on_output(RequestOutput("r", None, [1], [CompletionOutput(0, "", [2])], False))
    assert value(scrape(first), "vllm:time_to_first_token_seconds", "_count") == 1
    assert value(scrape(second), "vllm:time_to_first_token_seconds", "_count") == 0


def test_token_buckets_are_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4000)[-2:] == (1000, 2000)


def _output(token_counts, finished, reasons=None, metrics=None) -> RequestOutput:
    completions = [CompletionOutput(i, "", list(range(n)),
                                    finish_reason=reasons[i] if finished else None)
                   for i, n in enumerate(token_counts)]
    return RequestOutput("r", None, [7, 8, 9], completions, finished, metrics=metrics or {})


def test_a_request_with_two_sequences():
    metrics = ServerMetrics("tiny", 128)
    timer = metrics.timer(SamplingParams(n=2, max_tokens=4))
    timer.on_output(_output([1, 1], False))
    timer.on_output(_output([3, 2], False))  # two tokens in one output: two latencies
    timer.on_output(_output([4, 2], True, ["length", "stop"]))
    found = scrape(metrics)
    assert value(found, "vllm:request_success", "_total", finished_reason="length") == 1
    assert value(found, "vllm:request_success", "_total", finished_reason="stop") == 1
    assert value(found, "vllm:time_to_first_token_seconds", "_count") == 1
    assert value(found, "vllm:inter_token_latency_seconds", "_count") == 3 + 1
    assert value(found, "vllm:time_per_output_token_seconds", "_count") == 4
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens",
                 "request_params_max_tokens"):
        assert value(found, f"vllm:{name}", "_count") == 2, name
    assert value(found, "vllm:request_prompt_tokens", "_sum") == 6
    assert value(found, "vllm:request_generation_tokens", "_sum") == 6
    assert value(found, "vllm:request_params_max_tokens", "_sum") == 8
    assert value(found, "vllm:request_params_n", "_sum") == 2
    assert value(found, "vllm:request_max_num_generation_tokens", "_sum") == 4
    assert value(found, "vllm:request_queue_time_seconds", "_sum") == 0  # no engine timestamp


def test_engine_scheduling_time_splits_queue_from_prefill():
    metrics = ServerMetrics("tiny")
    timer = metrics.timer()
    scheduled = timer.arrival + 0.25
    timer.on_output(_output([1], True, ["stop"], {"first_scheduled_time": scheduled}))
    found = scrape(metrics)
    assert value(found, "vllm:request_queue_time_seconds", "_sum") == pytest.approx(0.25)
    total = (value(found, "vllm:request_queue_time_seconds", "_sum")
             + value(found, "vllm:request_prefill_time_seconds", "_sum"))
    assert total == pytest.approx(value(found, "vllm:time_to_first_token_seconds", "_sum"))


# -- a real server ------------------------------------------------------------------------------
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    remote = RemoteServer(tiny_llama_dir, [
        "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
        "--num-gpu-blocks-override", "64", "--block-size", "8", "--enforce-eager",
        "--served-model-name", "tiny", "tiny-alias", "--disable-log-requests",
        "--compilation-cache-dir", ""])
    yield remote
    remote.close()


def tokenizer_ids(server, text: str) -> list[int]:
    return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]


def test_counts_follow_requests(server):
    def get() -> dict:
        return families(httpx.get(server.url + "/metrics", timeout=10).text)

    before = get()
    client = server.client()
    client.completions.create(model="tiny", prompt="hello world", max_tokens=MAX_TOKENS, n=2,
                              temperature=0, extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny-alias", prompt="the lazy dog",
                                       max_tokens=MAX_TOKENS, stream=True,
                                       extra_body={"ignore_eos": True})
    assert sum(1 for _ in stream) >= 1
    after = get()

    def moved(name: str, suffix: str, **labels) -> float:
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    assert moved("vllm:request_success", "_total", finished_reason="length") == 3
    assert moved("jaxllm:request_success", "_total", finished_reason="length") == 3
    assert moved("vllm:generation_tokens", "_total") == 3 * MAX_TOKENS
    assert moved("vllm:prompt_tokens", "_total") > 0
    # Each of the three sequences looks its prompt up (the n = 2 pair counts twice).
    assert moved("vllm:prefix_cache_queries", "_total") == (
        2 * len(tokenizer_ids(server, "hello world")) + len(tokenizer_ids(server, "the lazy dog")))
    assert 0 <= moved("jaxllm:prefix_cache_hits", "_total") <= moved(
        "jaxllm:prefix_cache_queries", "_total")
    assert moved("vllm:time_to_first_token_seconds", "_count") == 2
    assert moved("vllm:e2e_request_latency_seconds", "_count") == 3
    assert moved("vllm:inter_token_latency_seconds", "_count") == 3 * (MAX_TOKENS - 1)
    assert moved("vllm:request_generation_tokens", "_sum") == 3 * MAX_TOKENS
    assert moved("vllm:request_params_n", "_sum") == 3
    assert moved("vllm:request_params_max_tokens", "_sum") == 3 * MAX_TOKENS
    assert moved("vllm:iteration_tokens_total", "_count") >= MAX_TOKENS  # a step per token at least
    assert moved("vllm:iteration_tokens_total", "_sum") >= 3 * MAX_TOKENS
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    info = after["vllm:cache_config_info"].samples[0].labels
    assert (info["block_size"], info["num_gpu_blocks"]) == ("8", "64")
    assert info["enable_prefix_caching"] == "True"
    assert {s.labels["model_name"] for s in after["vllm:prompt_tokens"].samples} == {"tiny"}
