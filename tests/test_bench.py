"""`jaxllm bench`: datasets, roofline arithmetic vs HF's own parameter count, serving metrics, and
the three subcommands end to end on the tiny Llama (serve against a real server subprocess)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxllm.bench import roofline, serve
from jaxllm.bench.datasets import (multi_turn_requests, prefix_repetition_requests,
                                   random_requests, sharegpt_requests)
from jaxllm.cli import main
from jaxllm.models.args import ModelArgs
from jaxllm.models.presets import PRESETS

ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-model-len", "128", "--max-num-batched-tokens", "16"]


# -- datasets ---------------------------------------------------------------------------------
def test_random_dataset_lengths_ids_and_seed():
    requests = random_requests(200, 100, 20, vocab_size=50, range_ratio=0.5, seed=3)
    input_lens = np.array([r.prompt_len for r in requests])
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert input_lens.min() >= 50 and input_lens.max() <= 150 and input_lens.std() > 10
    assert all(10 <= r.expected_output_len <= 30 for r in requests)
    assert all(0 <= t < 50 for r in requests for t in r.prompt)
    assert random_requests(200, 100, 20, 50, 0.5, seed=3) == requests
    assert random_requests(200, 100, 20, 50, 0.5, seed=4) != requests
    fixed = random_requests(5, 7, 3, vocab_size=50)
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(7, 3)}
    with pytest.raises(ValueError, match="range_ratio"):
        random_requests(5, 7, 3, 50, range_ratio=1.0)
    with pytest.raises(ValueError, match="num_prompts"):
        random_requests(0, 7, 3, 50)


def test_random_prefix_and_prefix_repetition_datasets():
    shared = random_requests(6, 5, 3, vocab_size=50, prefix_len=12, seed=1)
    assert all(r.prompt[:12] == shared[0].prompt[:12] and r.prompt_len == 17 == len(r.prompt)
               for r in shared)
    requests = prefix_repetition_requests(10, 16, 4, 3, 7, vocab_size=1000, seed=2)
    prefixes = [tuple(r.prompt[:16]) for r in requests]
    assert len(requests) == 10 and len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [3, 3, 4]
    assert {(r.prompt_len, r.expected_output_len, len(r.prompt)) for r in requests} == {(20, 7, 20)}
    assert prefixes != sorted(prefixes)  # shuffled
    with pytest.raises(ValueError, match="num_prefixes"):
        prefix_repetition_requests(2, 16, 4, 3, 7, 1000)


def test_multi_turn_dataset_and_throughput_rounds():
    from jaxllm.bench.throughput import run_throughput
    from jaxllm.outputs import CompletionOutput, RequestOutput

    requests = multi_turn_requests(7, 3, 5, 2, vocab_size=100, system_len=4, seed=0)
    assert [r.conversation for r in requests] == [0, 0, 0, 1, 1, 1]  # 7 // 3 conversations
    assert requests[0].prompt_len == 9 and requests[1].prompt_len == 5
    assert requests[0].prompt[:4] == requests[3].prompt[:4]  # one system prompt

    class EchoLLM:
        """Answers every prompt with [len(prompt)] * max_tokens; records the prompts."""
        prompts: list = []

        def generate(self, prompts, params, use_tqdm=True):
            self.prompts += [p["prompt_token_ids"] for p in prompts]
            return [RequestOutput("x", None, p["prompt_token_ids"], [CompletionOutput(
                0, "", [len(p["prompt_token_ids"])] * sp.max_tokens)], True)
                for p, sp in zip(prompts, params)]

    llm = EchoLLM()
    result = run_throughput(llm, requests, use_tqdm=False)
    assert result["num_requests"] == 6 and result["total_output_tokens"] == 12
    first, second = llm.prompts[0], llm.prompts[2]  # conversation 0, turns 1 and 2
    assert second == first + [9, 9] + requests[1].prompt


def test_sharegpt_dataset_filters_and_lengths(tmp_path, tiny_tokenizer):
    long_reply = "The quick brown fox jumps over the lazy dog. " * 8
    data = [{"conversations": [{"from": "human", "value": f"Hello world, request {i}?"},
                               {"from": "gpt", "value": long_reply}]} for i in range(6)]
    data += [{"conversations": [{"from": "human", "value": "Hi"},  # too short: dropped
                                {"from": "gpt", "value": "Hello world, how are you today?"}]},
             {"conversations": [{"from": "human", "value": "one turn only"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_requests(str(path), 6, tiny_tokenizer)
    assert len(requests) == 6 and all(r.prompt.startswith("Hello world") for r in requests)
    assert all(r.expected_output_len == len(tiny_tokenizer.encode(long_reply)) for r in requests)
    assert all(r.prompt_len == len(tiny_tokenizer.encode(r.prompt)) for r in requests)
    assert {r.expected_output_len for r in sharegpt_requests(str(path), 3, tiny_tokenizer,
                                                             output_len=5)} == {5}
    with pytest.raises(ValueError, match="7 were asked for"):
        sharegpt_requests(str(path), 7, tiny_tokenizer)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        sharegpt_requests(str(path), 1, None)


# -- roofline ---------------------------------------------------------------------------------
def _hf_matmul_params(preset: str) -> int:
    """Parameter count of HF's own model (meta device), without norms and the embedding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(PRESETS[preset])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for name, p in model.named_parameters()
               if "norm" not in name and "embed_tokens" not in name)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "mixtral-8x7b"])
def test_weight_bytes_match_hf_parameter_count(preset):
    args = ModelArgs.from_hf_config(PRESETS[preset])
    expected = _hf_matmul_params(preset)
    # A batch large enough to touch every expert reads every weight but the embedding table.
    every = roofline.weight_bytes_per_step(args, 4096) / 2 - 4096 * args.hidden_size
    assert every == pytest.approx(expected, rel=1e-6)


def test_decode_floor_of_llama_8b_at_2k_context():
    args = ModelArgs.from_hf_config(PRESETS["llama-3.1-8b"])
    assert roofline.kv_bytes_per_token(args) == 2 * 32 * 8 * 128 * 2
    ceilings = roofline.Ceilings(4.3e12, 4.3e12, 7.0e14, "test", "bfloat16")
    floor = roofline.decode_step_floor(args, 1, 2048, ceilings)
    assert floor["bound"] == "memory"
    assert floor["bytes"] / 1e9 == pytest.approx(15.28, abs=0.01)  # the 15.3 GB
    assert floor["floor_s"] * 1e3 == pytest.approx(3.55, abs=0.01)
    # Mixtral at batch 1 reads 2 of 8 experts per layer.
    mixtral = ModelArgs.from_hf_config(PRESETS["mixtral-8x7b"])
    one, every = (roofline.weight_bytes_per_step(mixtral, b) for b in (1, 4096))
    assert one < 0.4 * every


def test_floors_count_quantised_weights_and_fp8_pages_as_stored(tmp_path):
    """The 8B's batch-1 floor at 1,000 context: FP8 projections 1 byte (embedding row and LM
    head 2), int4 0.5 + 3 / group bytes, FP8 KV 1 byte; an engine's storage read from its
    config (the method resolved from a checkpoint's quantization_config)."""
    import json

    from jaxllm.engine.args import EngineArgs
    args = ModelArgs.from_hf_config(PRESETS["llama-3.1-8b"])
    head = args.hidden_size * (args.vocab_size + 1) * 2
    projections = roofline.weight_bytes_per_step(args, 1) / 2 - args.hidden_size * (
        args.vocab_size + 1)  # parameters
    for storage, per_param in [(roofline.Storage.of(2, "fp8"), 1.0),
                               (roofline.Storage.of(2, "gptq", {"quantization_config": {
                                   "group_size": 64}}), 0.5 + 3 / 64),
                               (roofline.Storage.of(2, "awq"), 0.5 + 3 / 128)]:
        assert roofline.weight_bytes_per_step(args, 1, storage) == pytest.approx(
            projections * per_param + head)
    ceilings = roofline.Ceilings(4.8e12, 4.8e12, 7.0e14, "test", "bfloat16")
    fp8 = roofline.decode_step_floor(args, 1, 1000, ceilings, roofline.Storage.of(2, "fp8"))
    kv = 1000 * 2 * 32 * 8 * 128
    assert fp8["bytes"] == pytest.approx(projections + head + 2 * kv)
    both = roofline.Storage.of(2, "fp8", kv_cache_dtype="fp8")
    assert roofline.decode_step_floor(args, 1, 1000, ceilings, both)["bytes"] == pytest.approx(
        projections + head + kv)
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-3.1-8b-fp8"]))
    config = EngineArgs(model=str(tmp_path), load_format="dummy", kv_cache_dtype="fp8",
                        dtype="bfloat16").create_engine_config()
    assert roofline.Storage.of_engine(config) == roofline.Storage(2, 1.0, 1.0)


def test_workload_floor_by_hand():
    args = ModelArgs.from_hf_config(PRESETS["llama-3.1-8b"])
    ceilings = roofline.Ceilings(1e12, 1e12, 1e14, "test", "bfloat16")
    floor = roofline.workload_floor(args, [10, 30], [4, 6], max_num_seqs=1, ceilings=ceilings)
    attended = (10 * 10 / 2 + 10 * 4 + 16 / 2) + (30 * 30 / 2 + 30 * 6 + 36 / 2)
    flops = (2 * roofline.active_params_per_token(args) * 50
             + 4 * attended * args.num_heads * args.head_dim * args.num_layers)
    assert floor["flops"] == pytest.approx(flops)
    kv_read = ((10 * 4 + 8) + (30 * 6 + 18)) * roofline.kv_bytes_per_token(args)
    # One sequence at a time: 4 + 6 = 10 decode steps, each reading the weights.
    assert floor["bytes"] == pytest.approx(10 * roofline.weight_bytes_per_step(args, 1) + kv_read)
    assert floor["floor_s"] == max(floor["memory_s"], floor["compute_s"])


def test_measure_ceilings_on_this_device():
    c = roofline.measure_ceilings("float32", copy_bytes=4 << 20, matmul_n=256, reps=3)
    for value in (c.hbm_bytes_per_s, c.gemv_bytes_per_s, c.matmul_flops_per_s):
        assert np.isfinite(value) and value > 1e6


def test_ceilings_of_a_mesh_divide_the_floor(monkeypatch):
    """A workload's floor counts all DP x PP x TP devices: the 8B decode floor over TP=4 x DP=2
    is an eighth of one device's, and PP=2 doubles the devices again. One decode step's floor
    divides by TP only (its stages run one after another; each DP replica reads all weights)."""
    from argparse import Namespace

    from jaxllm.bench.throughput import measure_ceilings_for

    one = roofline.Ceilings(4.0e12, 3.8e12, 7.9e14, "NVIDIA H200", "bfloat16")
    monkeypatch.setattr(roofline, "measure_ceilings", lambda dtype: one)
    eight = measure_ceilings_for(Namespace(dtype="bfloat16", tensor_parallel_size=4,
                                           data_parallel_size=2, pipeline_parallel_size=1))
    assert measure_ceilings_for(Namespace(dtype="bfloat16", tensor_parallel_size=4,
                                          data_parallel_size=2, pipeline_parallel_size=2)
                                ).device == "16 x NVIDIA H200"
    assert eight.device == "8 x NVIDIA H200" and eight.hbm_bytes_per_s == 8 * 4.0e12
    args = ModelArgs.from_hf_config(PRESETS["llama-3.1-8b"])
    single = roofline.decode_step_floor(args, 1, 2048, one)["floor_s"]
    assert roofline.decode_step_floor(args, 1, 2048, eight)["floor_s"] == pytest.approx(single / 8)
    assert one.times(1) is one
    tp2 = roofline.mesh_decode_step_floor(args, 1, 2048, one, tp=2, dp=1)["floor_s"]
    assert tp2 == pytest.approx(single / 2)
    assert roofline.mesh_decode_step_floor(args, 2, 2048, one, tp=2, dp=2)["floor_s"] == tp2


# -- serving metrics ----------------------------------------------------------------------------
def test_calculate_metrics_by_hand():
    ok = serve.RequestResult(prompt_len=10, success=True, output_tokens=5, ttft=0.1,
                             itl=[0.02, 0.03, 0.01, 0.04], latency=0.2)
    ok2 = serve.RequestResult(prompt_len=20, success=True, output_tokens=3, ttft=0.3,
                              itl=[0.05, 0.05], latency=0.4)
    failed = serve.RequestResult(prompt_len=7, error="HTTP 500")
    m = serve.calculate_metrics([ok, ok2, failed], duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 8)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx((0.1 / 4 + 0.1 / 2) / 2 * 1e3)
    assert m["median_itl_ms"] == pytest.approx(35.0)  # of 10 20 30 40 50 50
    assert m["p99_e2el_ms"] == pytest.approx(np.percentile([200.0, 400.0], 99))
    text = serve.format_result({**m, "max_concurrency": None, "request_rate": float("inf")})
    assert "Successful requests:                     2" in text
    assert "Mean TPOT (ms):" in text and "P99 ITL (ms):" in text


# -- the subcommands end to end -------------------------------------------------------------------
def test_bench_throughput(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    main(["bench", "throughput", "--model", tiny_llama_dir, "--num-prompts", "12",
          "--input-len", "20", "--output-len", "6", "--range-ratio", "0.3", "--disable-tqdm",
          "--output-json", str(out), *ENGINE_FLAGS])
    printed = capsys.readouterr().out
    assert "requests/s," in printed and "total tokens/s," in printed
    assert "output tokens/s" in printed and "Roofline: floor" in printed
    result = json.loads(out.read_text())
    assert result["num_requests"] == 12
    lens = random_requests(12, 20, 6, 384, range_ratio=0.3, seed=0)
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in lens)
    assert result["total_prompt_tokens"] == sum(r.prompt_len for r in lens)
    assert 0 < result["fraction_of_floor"] < 1


def test_bench_latency_and_decode_step(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", tiny_llama_dir, "--input-len", "24", "--output-len",
          "4", "--batch-size", "3", "--num-iters-warmup", "1", "--num-iters", "3",
          "--measure-decode", "--no-roofline", "--disable-tqdm", "--output-json", str(out),
          *ENGINE_FLAGS])
    printed = capsys.readouterr().out
    assert "Avg latency:" in printed and "99% percentile latency:" in printed
    assert "Decode step:" in printed
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and result["decode"]["num_steps"] == 8
    assert result["decode"]["median_step_ms"] > 0


def test_bench_serve_against_a_server(tiny_llama_dir, tmp_path, capsys):
    from jaxllm.server.testing import RemoteServer

    server = RemoteServer(tiny_llama_dir, ENGINE_FLAGS)
    try:
        main(["bench", "serve", "--base-url", server.url, "--tokenizer", tiny_llama_dir,
              "--num-prompts", "6", "--input-len", "16", "--output-len", "5",
              "--request-rate", "30", "--max-concurrency", "3", "--ignore-eos",
              "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
              "--result-filename", "serve.json"])
    finally:
        server.close()
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Maximum request concurrency:" in printed
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_output_tokens"] == 30 and result["total_input_tokens"] == 96
    assert result["model_id"] == tiny_llama_dir and result["max_concurrency"] == 3
    # At most one chunk per token after the first (the detokenizer may hold text back).
    assert all(len(itl) <= 4 for itl in result["itls"]) and any(result["itls"])
    assert 0 < result["mean_ttft_ms"] and 0 < result["mean_tpot_ms"] <= result["mean_e2el_ms"]
