"""Multi-LoRA serving against HF transformers + PEFT: one batch mixing the base model and three
adapters (more than the device slots, so slots are reused), token for token and logprob for
logprob (fp32); no compilation while adapters come and go; slot eviction; refusals."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from conftest import CompileCounter
from jaxllm import LLM, SamplingParams
from jaxllm.lora.request import LoRARequest
from lora_fixtures import save_random_peft_adapter

NUM_NEW_TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, targets, alpha, rslora): several ranks, one adapter on only some modules
ADAPTERS = {"all8": (8, ALL, 16, False), "qv16": (16, ["q_proj", "v_proj"], 8, False),
            "mlp4rs": (4, ["o_proj", "gate_proj", "down_proj"], 8, True)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def base_and_adapters(request, tiny_model_dirs, tmp_path_factory):
    base = tiny_model_dirs[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    adapters = {}
    for seed, (name, (rank, targets, alpha, rslora)) in enumerate(ADAPTERS.items()):
        adapters[name] = LoRARequest(name, seed + 1, save_random_peft_adapter(
            base, str(root / name), rank=rank, target_modules=targets, lora_alpha=alpha,
            use_rslora=rslora, seed=seed))
    return base, adapters


def hf_peft_greedy(base: str, adapter_dir: str | None, prompts, num_new_tokens: int):
    """Greedy tokens (EOS masked, as min_tokens does) and each one's logprob by HF transformers
    (+ PEFT)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    eos = model.config.eos_token_id
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids, logprobs = list(prompt), []
            for _ in range(num_new_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                raw = torch.log_softmax(logits, -1)  # the engine's logprobs: before min_tokens
                logits[eos] = -float("inf")
                token = int(torch.argmax(logits))
                logprobs.append(float(raw[token]))
                ids.append(token)
            results.append((ids[len(prompt):], logprobs))
    return results


def make_llm(base: str, **kwargs) -> LLM:
    defaults = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
                    num_gpu_blocks_override=64, block_size=8, compilation_cache_dir=None,
                    enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    return LLM(base, **{**defaults, **kwargs})


def mixed_batch(adapters):
    """Eight prompts: the base model and each adapter twice, interleaved."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, rng.integers(4, 30)).tolist() for _ in range(8)]
    loras = [None, adapters["all8"], adapters["qv16"], adapters["mlp4rs"],
             adapters["qv16"], None, adapters["mlp4rs"], adapters["all8"]]
    return prompts, loras


def test_mixed_batch_matches_hf_peft(base_and_adapters):
    base, adapters = base_and_adapters
    prompts, loras = mixed_batch(adapters)
    # two slots for three adapters: the scheduler holds back the third until a slot frees
    llm = make_llm(base, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS,
                            min_tokens=NUM_NEW_TOKENS, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    for prompt, lora, output in zip(prompts, loras, outputs):
        [(tokens, logprobs)] = hf_peft_greedy(base, lora and lora.lora_path, [prompt],
                                              NUM_NEW_TOKENS)
        completion = output.outputs[0]
        assert list(completion.token_ids) == tokens, lora
        got = [step[t].logprob for step, t in zip(completion.logprobs, tokens)]
        np.testing.assert_allclose(got, logprobs, atol=1e-4, err_msg=str(lora))
    # the adapters change the output (else this test could not fail)
    base_tokens = outputs[0].outputs[0].token_ids
    assert llm.generate([prompts[0]], params, use_tqdm=False,
                        lora_request=adapters["all8"])[0].outputs[0].token_ids != base_tokens


def test_no_compilation_while_adapters_come_and_go(base_and_adapters, tmp_path):
    base, adapters = base_and_adapters
    if "qwen3" in base:
        pytest.skip("one model suffices")
    llm = make_llm(base, max_num_batched_tokens=32)
    prompts, loras = mixed_batch(adapters)
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6)
        llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        engine = llm.llm_engine
        assert engine.remove_lora(adapters["qv16"].lora_int_id)
        late = LoRARequest("late", 9, adapters["all8"].lora_path)
        llm.generate(prompts[:3], params, use_tqdm=False,
                     lora_request=[late, adapters["qv16"], None])
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == engine.num_blocks - 1
    assert stats["lora_running"] == () and stats["lora_waiting"] == ()


def test_slots_are_reused_least_recently_used_first(base_and_adapters):
    base, adapters = base_and_adapters
    if "qwen3" in base:
        pytest.skip("one model suffices")
    llm = make_llm(base, enforce_eager=True, max_cpu_loras=3)
    slots = llm.llm_engine.runner.lora
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for name in ("all8", "qv16", "all8", "mlp4rs"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False, lora_request=adapters[name])
    # all8 was used after qv16, so mlp4rs took qv16's slot
    assert slots.held == [None, adapters["all8"].lora_int_id, adapters["mlp4rs"].lora_int_id]
    assert llm.llm_engine.list_loras() == {1, 2, 3}
    # the host cache keeps adapters in the slots' layout: moving one in is a copy per array
    packed = slots.host_cache.get(adapters["mlp4rs"])
    for name, array in packed.items():
        assert array.dtype == slots.stacks[0][name].dtype
        np.testing.assert_array_equal(np.asarray(slots.stacks[1][name][2]), array[1])


def test_bad_adapters_and_lora_off_are_refused(base_and_adapters, tmp_path, tiny_llama_dir):
    base, adapters = base_and_adapters
    if "qwen3" in base:
        pytest.skip("one model suffices")
    llm = make_llm(base, enforce_eager=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="greater than max_lora_rank 8"):
        llm.generate([[5, 6]], params, use_tqdm=False, lora_request=adapters["qv16"])
    with pytest.raises(ValueError, match="No LoRA adapter found"):
        llm.generate([[5, 6]], params, use_tqdm=False,
                     lora_request=LoRARequest("missing", 7, str(tmp_path / "nothing")))
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.get_stats()["num_free_blocks"] == engine.num_blocks - 1
    plain = make_llm(base, enforce_eager=True, enable_lora=False)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([[5, 6]], params, use_tqdm=False, lora_request=adapters["all8"])
    with pytest.raises(ValueError, match="max_lora_rank"):
        make_llm(base, max_lora_rank=12)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        make_llm(base, max_loras=3, max_cpu_loras=2)


def test_prefix_cache_never_shares_kv_across_adapters(base_and_adapters):
    base, adapters = base_and_adapters
    if "qwen3" in base:
        pytest.skip("one model suffices")
    llm = make_llm(base, enforce_eager=True)
    prompt = list(range(10, 50))  # five full blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters["all8"])[0]
    hits = llm.llm_engine.get_stats()["prefix_cache_hits_total"]
    other = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters["qv16"])[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits_total"] == hits  # no sharing
    again = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters["all8"])[0]
    assert llm.llm_engine.get_stats()["prefix_cache_hits_total"] > hits  # same adapter: shared
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_server_serves_adapters_by_name_and_at_runtime(base_and_adapters, monkeypatch):
    """The openai client picks adapters through `model`; adapters load and unload at runtime
    (allowed by the environment variable); each answer equals HF + PEFT."""
    import httpx
    import openai

    from jaxllm.server.testing import RemoteServer

    base, adapters = base_and_adapters
    if "qwen3" in base:
        pytest.skip("one model suffices")
    monkeypatch.setenv("JAXLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    all8, qv16 = adapters["all8"], adapters["qv16"]
    server = RemoteServer(base, ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                                 "--lora-modules", f"all8={all8.lora_path}", "--max-model-len",
                                 "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                                 "--num-gpu-blocks-override", "64", "--block-size", "8",
                                 "--compilation-cache-dir", ""])
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        prompt = [17, 42, 99, 7, 150, 23]

        def complete(model: str) -> list[int]:
            choice = client.completions.create(
                model=model, prompt=prompt, max_tokens=6, temperature=0.0,
                extra_body={"min_tokens": 6, "return_token_ids": True}).choices[0]
            return choice.model_extra["token_ids"]

        def expected(lora) -> list[int]:
            return hf_peft_greedy(base, lora and lora.lora_path, [prompt], 6)[0][0]

        cards = {m.id: m for m in client.models.list().data}
        assert cards["all8"].parent == next(iter(cards)) and cards["all8"].root == all8.lora_path
        assert complete("all8") == expected(all8)
        http = httpx.Client(base_url=server.url)
        load = http.post("/v1/load_lora_adapter",
                         json={"lora_name": "qv16", "lora_path": qv16.lora_path})
        assert load.status_code == 200 and "added successfully" in load.text
        again = http.post("/v1/load_lora_adapter",
                          json={"lora_name": "qv16", "lora_path": qv16.lora_path})
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nope"})
        assert bad.status_code == 400 and bad.json()["error"]["message"]
        assert complete("qv16") == expected(qv16)
        assert complete(next(iter(cards))) == expected(None)
        metrics = http.get("/metrics").text
        assert 'lora_requests_info{max_lora="2"' in metrics
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv16"}).status_code == 200
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "qv16"}).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete("qv16")
    finally:
        server.close()


def _pallas_kernels(interpret: bool):
    from functools import partial

    from pallas_kernels import lora as kernels
    return partial(kernels.lora_add, interpret=interpret)


def test_the_gpu_path_adds_what_the_reference_adds_and_lowers_for_cuda(monkeypatch):
    """TokenLoRA.add through the Pallas kernels (interpret mode) equals the reference path on
    the fused qkv layout with scattered slots, and lowers for an H200."""
    import jax.numpy as jnp

    from conftest import lower_for_h200
    from jaxllm.models import lora as model_lora

    rng = np.random.default_rng(0)
    num_tokens, hidden, num_kv, group, head_dim, rank, num_slots = 13, 64, 2, 3, 16, 16, 4
    fan_out = num_kv * (group + 2) * head_dim
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.float32)
    base = jnp.asarray(rng.standard_normal((num_tokens, num_kv, group + 2, head_dim)), jnp.float32)
    a = rng.standard_normal((num_slots, hidden, 3 * rank)).astype(np.float32)
    b = rng.standard_normal((num_slots, 3 * rank, fan_out)).astype(np.float32)
    a[0], b[0] = 0, 0  # slot 0: the base model
    stacks = {"qkv_a": jnp.asarray(a), "qkv_b": jnp.asarray(b)}
    slots = jnp.asarray(rng.integers(0, num_slots, num_tokens), jnp.int32)
    lora = model_lora.TokenLoRA(stacks, slots)
    want = lora.add(base, x, "qkv")
    assert not np.allclose(want, base)  # the update is there
    monkeypatch.setattr(model_lora, "_lora_add", lambda: _pallas_kernels(True))
    np.testing.assert_allclose(lora.add(base, x, "qkv"), want, rtol=2e-5, atol=2e-4)
    monkeypatch.setattr(model_lora, "_lora_add", lambda: _pallas_kernels(False))
    spec = jax.ShapeDtypeStruct
    lowered = lower_for_h200(
        lambda base, x, a, b, s: model_lora.TokenLoRA({"qkv_a": a, "qkv_b": b}, s).add(
            base, x, "qkv"),
        spec((256, 8, 6, 128), jnp.bfloat16), spec((256, 4096), jnp.bfloat16),
        spec((17, 4096, 48), jnp.bfloat16), spec((17, 48, 6144), jnp.bfloat16),
        spec((256,), jnp.int32))
    assert "triton" in lowered.lower()
