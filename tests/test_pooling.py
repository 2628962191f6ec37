"""Pooling models on CPU: all-MiniLM-L6-v2 against sentence-transformers (offline and through the
server's /v1/embeddings with the openai client), random BERT/RoBERTa classifiers and a Qwen3
decoder embedder/classifier against HF transformers, score/rerank against direct computations,
no compilation after warm-up, vLLM's length errors and truncation."""

from __future__ import annotations

import base64
import random
import shutil

import httpx
import jax
import numpy as np
import pytest

from conftest import TINY_CONFIGS, CompileCounter, _randomize
from lora_fixtures import save_random_peft_adapter
from jaxllm import LLM, LoRARequest
from jaxllm.pooling_params import PoolingParams

SENTENCES = [
    "a",
    "Hi!",
    "The quick brown fox jumps over the lazy dog.",
    "这是一个用于测试句子嵌入的中文句子。",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "مرحبا بالعالم، هذه جملة اختبار",
    "emoji 🚀🔥 and naïve café résumé",
    " ".join(["retrieval augmented generation needs an embeddings endpoint"] * 46),  # 508 tokens
]
ENGINE = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    from jaxllm.loader.embedding_model import minilm_dir as fetch
    return fetch()


@pytest.fixture(scope="module")
def st_reference(minilm_dir):
    """sentence-transformers' embeddings (fp32, torch), over up to 512 tokens as ours."""
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(minilm_dir, device="cpu")
    model.max_seq_length = 512
    return model


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    """Warmed up: every batch shape compiled."""
    return LLM(minilm_dir, **ENGINE)


def test_minilm_embed_equals_sentence_transformers(minilm, st_reference):
    outputs = minilm.embed(SENTENCES, use_tqdm=False)
    lengths = [len(o.prompt_token_ids) for o in outputs]
    assert min(lengths) == 3 and max(lengths) == 508, lengths
    ours = np.array([o.outputs.embedding for o in outputs])
    reference = st_reference.encode(SENTENCES, convert_to_numpy=True)
    assert ours.shape == reference.shape == (len(SENTENCES), 384)
    assert cosines(ours, reference).min() >= 0.99999, cosines(ours, reference)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)



def test_no_compilation_after_warmup(minilm):
    vocab = minilm.llm_engine.vocab_size
    rng = random.Random(0)
    minilm.embed([[101, 102]], use_tqdm=False)  # host-side paths once
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        for _ in range(4):
            prompts = [[rng.randrange(1000, vocab) for _ in range(rng.choice(
                [rng.randint(1, 20), rng.randint(1, 512)]))] for _ in range(rng.randint(1, 20))]
            outputs = minilm.embed(prompts, use_tqdm=False)
            assert [len(o.prompt_token_ids) for o in outputs] == list(map(len, prompts))
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"


def test_batches_overlap_and_an_aborted_request_in_flight_is_dropped(minilm, st_reference):
    """Several batches: each step launches the next before finishing the one in flight, and the
    embeddings are those of one prompt at a time; a request aborted while its batch runs gets no
    output."""
    from jaxllm.pooling_params import PoolingParams

    engine = minilm.llm_engine
    texts = ["A short one.", "The quick brown fox jumps over the lazy dog.", "東京は晴れ", "x y z"]
    ids = [minilm.input_processor.process(t).token_ids for t in texts]
    want = st_reference.encode(texts, convert_to_numpy=True)
    for i in range(24):  # 8 rows per step: three batches
        engine.add_request(f"r{i}", ids[i % 4], PoolingParams(task="embed"))
    assert engine.step() == []  # the first batch is launched, not finished
    engine.abort_request(["r3"])  # in flight
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    got = {o.request_id: o.outputs.data for o in outputs}
    assert sorted(got, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(24) if i != 3]
    for request_id, embedding in got.items():
        assert cosines(embedding[None], want[int(request_id[1:]) % 4][None])[0] > 0.99999


def test_too_long_and_truncation(minilm):
    ids = list(range(1000, 1513))  # 513 tokens
    with pytest.raises(ValueError, match=r"longer than the maximum model length of 512"):
        minilm.embed([ids], use_tqdm=False)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(600\) is greater"):
        minilm.embed([ids], truncate_prompt_tokens=600, use_tqdm=False)
    truncated = minilm.embed([ids], truncate_prompt_tokens=100, use_tqdm=False)[0]
    direct = minilm.embed([ids[-100:]], use_tqdm=False)[0]
    assert truncated.prompt_token_ids == ids[-100:]
    np.testing.assert_allclose(truncated.outputs.embedding, direct.outputs.embedding, atol=1e-6)
    assert not minilm.llm_engine.has_unfinished_requests()


def test_a_bad_prompt_behind_running_steps_raises_and_leaves_nothing(minilm, st_reference):
    """LLM.embed adds a long list a step's worth at a time (ids made while steps run): a bad
    prompt several steps in raises the per-request check's error, the engine keeps nothing of
    the call, and the next call's embeddings are right."""
    vocab = minilm.llm_engine.vocab_size
    rows = minilm.llm_engine.config.scheduler_config.max_num_seqs
    prompts = [[101, 1000 + i, 102] for i in range(5 * rows)]
    prompts[4 * rows + 1] = [101, vocab, 102]
    with pytest.raises(ValueError, match=rf"Token id {vocab} is out of vocabulary"):
        minilm.embed(prompts, use_tqdm=False)
    outputs = minilm.embed(["A short one.", "x y z"], use_tqdm=False)
    assert not minilm.llm_engine.has_unfinished_requests()
    assert len(minilm.llm_engine.scheduler.waiting) == 0
    want = st_reference.encode(["A short one.", "x y z"], convert_to_numpy=True)
    assert cosines(np.array([o.outputs.embedding for o in outputs]), want).min() > 0.99999


def test_api_mismatches_are_refused(minilm):
    from jaxllm import SamplingParams
    with pytest.raises(ValueError, match="only supported for generative models"):
        minilm.generate(["hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="classify task is not supported"):
        minilm.classify(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        minilm.embed(["hello"], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    assert not minilm.llm_engine.has_unfinished_requests()


def test_score_is_cosine_of_embeddings(minilm, st_reference):
    query, docs = "What is the capital of France?", ["Paris is in France.", "Bananas", "Berlin"]
    scores = [o.outputs.score for o in minilm.score(query, docs, use_tqdm=False)]
    emb = st_reference.encode([query] + docs)
    np.testing.assert_allclose(scores, cosines(emb[:1], emb[1:]), atol=1e-5)


# -- random encoders and decoders against HF ------------------------------------------------------
_TINY_BERT = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128)


def _save_encoder(tmp_path, minilm_dir, model_type: str, cls_name: str, **extra) -> str:
    import torch
    import transformers
    config = transformers.AutoConfig.for_model(model_type, **{**_TINY_BERT, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config)
    _randomize(model, 0)
    out = str(tmp_path / cls_name)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{minilm_dir}/{name}", out)
    return out


@pytest.mark.parametrize("model_type,cls_name,extra", [
    ("bert", "BertForSequenceClassification", dict(num_labels=3)),
    ("xlm-roberta", "XLMRobertaForSequenceClassification",
     dict(num_labels=3, pad_token_id=1, max_position_embeddings=130, type_vocab_size=1)),
])
def test_random_encoder_classifier_equals_hf(tmp_path, minilm_dir, model_type, cls_name, extra):
    import torch
    import transformers
    path = _save_encoder(tmp_path, minilm_dir, model_type, cls_name, **extra)
    llm = LLM(path, enforce_eager=True, max_num_seqs=4)
    assert llm.llm_engine.task == "classify"
    texts = SENTENCES[:6]
    ours = np.array([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    hf = getattr(transformers, cls_name).from_pretrained(path).eval()
    tokenizer = llm.get_tokenizer()
    with torch.no_grad():
        logits = [hf(**tokenizer(t, return_tensors="pt")).logits[0] for t in texts]
    reference = torch.softmax(torch.stack(logits), -1).numpy()
    np.testing.assert_allclose(ours, reference, atol=2e-5)


def test_cross_encoder_score_and_rerank_equal_hf(tmp_path, minilm_dir):
    import torch
    import transformers
    path = _save_encoder(tmp_path, minilm_dir, "bert", "BertForSequenceClassification",
                         num_labels=1)
    llm = LLM(path, enforce_eager=True, max_num_seqs=4)
    query, docs = "capital of France", ["Paris is the capital of France.", "a banana", "Berlin"]
    ours = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    hf = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    batch = llm.get_tokenizer()([query] * 3, docs, return_tensors="pt", padding=True)
    with torch.no_grad():
        reference = torch.sigmoid(hf(**batch).logits[:, 0]).numpy()
    np.testing.assert_allclose(ours, reference, atol=2e-5)


def _qwen3(tmp_path, tiny_tokenizer, cls_name: str, **extra) -> str:
    import torch
    import transformers
    cfg = dict(TINY_CONFIGS["qwen3"], **extra)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config)
    _randomize(model, 3)
    out = str(tmp_path / cls_name)
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def _hf_last_hidden(path: str, texts: list[str], tokenizer, adapter: str | None = None):
    """HF's last token's final hidden state; with adapter, through PEFT's LoRA layers (unmerged)
    that PeftModel puts into the causal LM's decoder."""
    import torch
    import transformers
    causal = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel
        PeftModel.from_pretrained(causal, adapter)
    decoder = causal.model.eval()
    with torch.no_grad():
        return np.stack([decoder(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, -1]
                         .numpy() for t in texts])


def test_qwen3_embedder_equals_hf(tmp_path, tiny_tokenizer):
    path = _qwen3(tmp_path, tiny_tokenizer, "Qwen3ForCausalLM", is_matryoshka=True)
    llm = LLM(path, runner="pooling", enforce_eager=True, max_num_seqs=4)  # convert auto: embed
    texts = ["The quick brown fox", "Hello world, how are you today?", "JAX"]
    ours = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    reference = _hf_last_hidden(path, texts, llm.get_tokenizer())
    assert cosines(ours, reference).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, atol=1e-5)
    short = llm.embed(texts, pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    short = np.array([o.outputs.embedding for o in short])
    assert short.shape == (3, 16) and cosines(short, reference[:, :16]).min() >= 0.99999



def test_qwen3_embedder_lora_equals_hf_peft(tmp_path, tiny_tokenizer):
    """One embed call mixing the base model and two adapters (one on only some modules), with
    max_loras=1: the adapters take turns in the one slot, and nothing compiles after warm-up."""
    path = _qwen3(tmp_path, tiny_tokenizer, "Qwen3ForCausalLM")
    adapters = [
        save_random_peft_adapter(path, str(tmp_path / "all"), rank=8, lora_alpha=16, seed=1,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"]),
        save_random_peft_adapter(path, str(tmp_path / "qv"), rank=4, lora_alpha=8, seed=2,
                                 target_modules=["q_proj", "v_proj"])]
    loras = [None] + [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters)]
    llm = LLM(path, runner="pooling", enable_lora=True, max_loras=1, max_lora_rank=8,
              max_model_len=32, max_num_seqs=4)
    texts = ["The quick brown fox", "Hello world, how are you today?", "JAX"]
    assert_mixed_lora_embeddings(llm, texts, loras, lambda lora: _hf_last_hidden(
        path, texts, llm.get_tokenizer(), lora and lora.lora_path))


def assert_mixed_lora_embeddings(llm, texts: list[str], loras: list, reference) -> None:
    """One embed call over every (text, adapter) pair, adapters interleaved so batches mix
    them: nothing compiles, each adapter's embeddings equal reference(lora) (cosine >= 0.99999)
    and differ from the base model's."""
    order = [(t, k) for k in range(len(loras)) for t in range(len(texts))][::-1]
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        outputs = llm.embed([texts[t] for t, _ in order],
                            lora_request=[loras[k] for _, k in order], use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"
    ours = {key: o.outputs.embedding for key, o in zip(order, outputs)}
    base = np.array([ours[t, 0] for t in range(len(texts))])
    for k, lora in enumerate(loras):
        mine = np.array([ours[t, k] for t in range(len(texts))])
        assert cosines(mine, reference(lora)).min() >= 0.99999, k
        if k:  # the adapter changes the embedding
            assert cosines(mine, base).max() < 0.999


def test_pooling_batches_keep_within_max_loras_with_the_step_in_flight():
    from jaxllm.core.pooling_scheduler import PoolingRequest, PoolingScheduler
    scheduler = PoolingScheduler(32, {16: [1, 4], 32: [1, 4]}, max_loras=1)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    for i, lora in enumerate([None, a, b, a, None]):
        scheduler.add_request(PoolingRequest(str(i), [5] * 3, PoolingParams(), lora))
    ids = lambda batch: [r.request_id for r in batch]  # noqa: E731
    assert ids(scheduler.schedule()) == ["0", "1", "3", "4"]  # b would be a second adapter
    assert ids(scheduler.schedule(held_loras={1})) == []  # a's step is in flight: b waits
    assert ids(scheduler.schedule()) == ["2"]


def _bert_peft_adapter(base: str, out: str, rank: int, seed: int, targets: list[str]) -> str:
    """A random PEFT adapter on the BertModel in `base`."""
    import transformers
    return save_random_peft_adapter(base, out, rank=rank, lora_alpha=2 * rank, seed=seed,
                                    target_modules=targets, scale=0.5,
                                    model_class=transformers.BertModel)


def _bert_cls(path: str, adapter: str | None, texts: list[str], tokenizer) -> np.ndarray:
    """HF BertModel's CLS hidden states (the default pooling), through PEFT with an adapter."""
    import torch
    import transformers
    from peft import PeftModel
    model = transformers.BertModel.from_pretrained(path, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return np.stack([model.eval()(**tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0]
                         .numpy() for t in texts])


def test_bert_embedder_lora_equals_hf_peft(tmp_path, minilm_dir):
    """LoRA on an encoder: one embed call mixing the base model and two adapters (every
    projection; query/value only) with max_loras=1, equal to HF BertModel + PEFT (CLS pooling,
    normalised); nothing compiles after warm-up."""
    path = _save_encoder(tmp_path, minilm_dir, "bert", "BertModel")
    every = ["query", "key", "value", "attention.output.dense", "intermediate.dense",
             "output.dense"]
    adapters = [_bert_peft_adapter(path, str(tmp_path / "all"), 8, 1, every),
                _bert_peft_adapter(path, str(tmp_path / "qv"), 4, 2, ["query", "value"])]
    loras = [None] + [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters)]
    llm = LLM(path, enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=64,
              max_num_seqs=4)
    texts = SENTENCES[:3]
    assert_mixed_lora_embeddings(llm, texts, loras, lambda lora: _bert_cls(
        path, lora and lora.lora_path, texts, llm.get_tokenizer()))


def test_bert_adapter_on_an_unsupported_module_is_refused(tmp_path, minilm_dir):
    path = _save_encoder(tmp_path, minilm_dir, "bert", "BertModel")
    adapter = _bert_peft_adapter(path, str(tmp_path / "pooler"), 4, 1, ["pooler.dense"])
    llm = LLM(path, enable_lora=True, max_lora_rank=8, enforce_eager=True)
    with pytest.raises(ValueError, match=r"pooler\.dense is not supported"):
        llm.embed(["hello"], lora_request=LoRARequest("p", 1, adapter), use_tqdm=False)


def test_generative_model_refuses_pooling(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, enforce_eager=True, max_model_len=64, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="only supported for pooling models"):
        llm.embed(["hello"])


def test_qwen3_classifier_equals_hf(tmp_path, tiny_tokenizer):
    import torch
    import transformers
    path = _qwen3(tmp_path, tiny_tokenizer, "Qwen3ForSequenceClassification", num_labels=3)
    llm = LLM(path, enforce_eager=True, max_num_seqs=4)  # auto: pooling, classify
    texts = ["The quick brown fox", "Hello world, how are you today?"]
    ours = np.array([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    hf = transformers.Qwen3ForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = [hf(**llm.get_tokenizer()(t, return_tensors="pt")).logits[0] for t in texts]
    np.testing.assert_allclose(ours, torch.softmax(torch.stack(logits), -1).numpy(), atol=2e-5)


# -- the server -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(minilm_dir):
    from jaxllm.server.testing import RemoteServer
    remote = RemoteServer(minilm_dir, ["--max-model-len", "512", "--served-model-name", "minilm",
                                       "--max-num-seqs", "8", "--enforce-eager"])
    yield remote
    remote.close()


def test_server_embeds_and_scores_with_an_adapter_named_in_model(tmp_path, minilm_dir):
    """--lora-modules on an encoder: the openai client's embeddings.create with the adapter's
    name equals HF + PEFT, the base model's name the base; /score takes the adapter too."""
    from openai import OpenAI

    from jaxllm.server.testing import RemoteServer
    path = _save_encoder(tmp_path, minilm_dir, "bert", "BertModel")
    adapter = _bert_peft_adapter(path, str(tmp_path / "all"), 8, 1, ["query", "value",
                                                                     "output.dense"])
    remote = RemoteServer(path, ["--served-model-name", "bert", "--enable-lora",
                                 "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}",
                                 "--max-model-len", "64", "--max-num-seqs", "4",
                                 "--enforce-eager"])
    try:
        client = OpenAI(base_url=remote.url + "/v1", api_key="none")
        texts = SENTENCES[:3]
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
        for model, lora in (("sql", adapter), ("bert", None)):
            response = client.embeddings.create(model=model, input=texts, encoding_format="float")
            ours = np.array([d.embedding for d in response.data])
            assert cosines(ours, _bert_cls(path, lora, texts, tokenizer)).min() >= 0.99999, model
        scores = {model: httpx.post(remote.url + "/score", json={
            "model": model, "text_1": texts[0], "text_2": texts[1:]}).json()["data"]
            for model in ("sql", "bert")}
        reference = _bert_cls(path, adapter, texts, tokenizer)
        np.testing.assert_allclose([d["score"] for d in scores["sql"]],
                                   cosines(reference[:1], reference[1:]), atol=1e-5)
        assert scores["sql"] != scores["bert"]
    finally:
        remote.close()


def test_openai_client_embeddings_float_and_base64(server, st_reference):
    from openai import OpenAI
    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    reference = st_reference.encode(SENTENCES)
    as_float = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    as_b64 = client.embeddings.create(model="minilm", input=SENTENCES)  # the client's base64
    for response in (as_float, as_b64):
        ours = np.array([d.embedding for d in response.data])
        assert cosines(ours, reference).min() >= 0.99999
        assert response.usage.prompt_tokens == response.usage.total_tokens > 512
    raw = httpx.post(server.url + "/v1/embeddings", json={
        "input": [[101, 7592, 102]], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    assert vector.shape == (384,) and raw["usage"]["prompt_tokens"] == 3


def test_server_score_rerank_and_errors(server, st_reference):
    query, docs = "capital of France", ["Berlin is German.", "Paris is in France.", "bananas"]
    emb = st_reference.encode([query] + docs)
    expected = cosines(emb[:1], emb[1:])
    score = httpx.post(server.url + "/score", json={"text_1": query, "text_2": docs}).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], expected, atol=1e-5)
    rerank = httpx.post(server.url + "/v1/rerank", json={
        "query": query, "documents": docs, "top_n": 2}).json()
    order = list(np.argsort(-expected)[:2])
    assert [r["index"] for r in rerank["results"]] == order
    assert rerank["results"][0]["document"]["text"] == docs[order[0]]
    np.testing.assert_allclose([r["relevance_score"] for r in rerank["results"]],
                               expected[order], atol=1e-5)
    too_long = httpx.post(server.url + "/v1/embeddings", json={"input": [list(range(1000, 1600))]})
    assert too_long.status_code == 400
    assert ("maximum context length is 512 tokens. However, you requested 600 tokens in the "
            "input for embedding generation") in too_long.json()["error"]["message"]
    truncated = httpx.post(server.url + "/v1/embeddings", json={
        "input": [list(range(1000, 1600))], "truncate_prompt_tokens": 10}).json()
    assert truncated["usage"]["prompt_tokens"] == 10
    completion = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
    assert completion.status_code == 400 and "pooling model" in completion.json()["error"]["message"]
    dims = httpx.post(server.url + "/v1/embeddings", json={"input": "hi", "dimensions": 8})
    assert dims.status_code == 400 and "matryoshka" in dims.json()["error"]["message"]


def test_bert_gelu_is_the_exact_gelu():
    """BERT's GELU (computed in fp32 by hand for speed) on fp16 inputs: jax's exact GELU of the
    same values to fp16's precision (in the far negative tail, where 1 + erf cancels, to 1e-5);
    the tanh form is jax's."""
    import jax
    import jax.numpy as jnp

    from jaxllm.models.bert import gelu

    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 4, jnp.float16)
    want = jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(jnp.float16)
    np.testing.assert_allclose(np.asarray(gelu(x, False), np.float32),
                               np.asarray(want, np.float32), rtol=1e-3, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(gelu(x, True)),
                                  np.asarray(jax.nn.gelu(x, approximate=True)))
