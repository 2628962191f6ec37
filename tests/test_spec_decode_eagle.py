"""Speculative decoding with EAGLE and EAGLE-3 heads: after every engine step, each request's
drafts equal those of a straightforward reference of the EAGLE draft forward (torch, dense causal
attention over the whole history, recomputed for every draft) on random heads in the public
checkpoints' layout; greedy output equals the engine without speculation (with preemption and
chunked prefill); no compilation after warm-up; the config's refusals."""

from __future__ import annotations

import json
import os
import random

import jax
import numpy as np
import pytest

from conftest import TINY_CONFIGS, CompileCounter, save_random_checkpoint
from jaxllm.engine.args import EngineArgs
from jaxllm.models.eagle import eagle3_aux_layers
from test_spec_decode import (GREEDY, drafts_checked_after_every_step, make_llm, mixed_params,
                              repetitive_prompts, token_ids)

K = 3
DRAFT_VOCAB = 200  # EAGLE-3's draft vocabulary, a subset of the target's 384


def eagle_spec(head_dir: str, method: str = "eagle", k: int = K) -> dict:
    return {"method": method, "model": head_dir, "num_speculative_tokens": k}


def _layer_tensors(rng, cfg: dict, in_size: int) -> dict[str, np.ndarray]:
    """A Llama decoder layer's tensors ([out, in], HF names) with `in_size` attention inputs."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj.weight": (q, in_size), "self_attn.k_proj.weight": (kv, in_size),
              "self_attn.v_proj.weight": (kv, in_size), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter), "post_attention_layernorm.weight": (h,)}
    return {name: (1 + 0.1 * rng.standard_normal(shape) if "norm" in name
                   else 0.1 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def save_eagle_head(out_dir: str, target_cfg: dict, eagle3: bool, seed: int,
                    aux_ids: list[int] | None = None) -> str:
    """A random head in the public checkpoints' layout (EAGLE: fc with bias, layers.0.*;
    EAGLE-3: midlayer.*, norm, lm_head over DRAFT_VOCAB ids and d2t; aux_ids: the target
    layers it reads, in vLLM's config key, else the recipe's three)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, vocab = target_cfg["hidden_size"], target_cfg["vocab_size"]
    prefix = "midlayer." if eagle3 else "layers.0."
    tensors = {prefix + name: value
               for name, value in _layer_tensors(rng, target_cfg, (2 if eagle3 else 1) * h).items()}
    num_features = len(aux_ids or [0, 0, 0]) if eagle3 else 2
    tensors["fc.weight"] = (0.1 * rng.standard_normal((h, num_features * h))).astype(np.float32)
    tensors["embed_tokens.weight"] = np.zeros((vocab, h), np.float32)  # skipped: shared
    config = {k: v for k, v in target_cfg.items() if k != "model_type"}
    config.update(architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"],
                  num_hidden_layers=1)
    if eagle3:
        for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                     "norm.weight"):
            tensors[name] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        tensors["lm_head.weight"] = (0.3 * rng.standard_normal((DRAFT_VOCAB, h))
                                     ).astype(np.float32)
        ids = np.sort(rng.choice(vocab, DRAFT_VOCAB, replace=False))
        tensors["d2t"] = (ids - np.arange(DRAFT_VOCAB)).astype(np.int64)
        tensors["t2d"] = np.isin(np.arange(vocab), ids)
        config["draft_vocab_size"] = DRAFT_VOCAB
        if aux_ids:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids}
    else:
        tensors["fc.bias"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


class EagleReference:
    """The EAGLE draft forward written out in torch (fp64) from the papers' definitions, over a
    request's whole history each time: the target's features from HF transformers, then per
    draft the head over every (token, feature) pair so far, dense causal attention."""

    def __init__(self, target_dir: str, head_dir: str, eagle3: bool) -> None:
        import torch
        from safetensors.numpy import load_file
        from transformers import AutoModelForCausalLM
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.torch = torch
        self.target = AutoModelForCausalLM.from_pretrained(target_dir,
                                                           dtype=torch.float64).eval()
        self.cfg = self.target.config
        self.rotary = LlamaRotaryEmbedding(self.cfg)
        self.w = {k: torch.from_numpy(np.asarray(v, np.float64) if v.dtype != np.int64 else v)
                  for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items()}
        self.eagle3 = eagle3
        self.prefix = "midlayer." if eagle3 else "layers.0."
        with open(os.path.join(head_dir, "config.json")) as f:
            self.aux = (json.load(f).get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids") or eagle3_aux_layers(
                    self.cfg.num_hidden_layers)

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy drafts after `tokens` (the last one not yet computed by the target)."""
        torch, w = self.torch, self.w
        with torch.no_grad():
            out = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
            if self.eagle3:
                streams = [out.hidden_states[i][0] for i in self.aux]
                features = torch.cat(streams, -1) @ w["fc.weight"].T
            else:
                features = out.hidden_states[-1][0]  # after the final norm
            pairs_tokens, drafts = list(tokens[1:]), []
            for _ in range(k):
                hidden = self._head(pairs_tokens, features)
                drafts.append(self._greedy(hidden[-1]))
                pairs_tokens.append(drafts[-1])
                features = torch.cat([features, hidden[-1:]])
            return drafts

    def _head(self, token_ids: list[int], features):
        torch, w, p, cfg = self.torch, self.w, self.prefix, self.cfg
        embeds = self.target.model.embed_tokens.weight[torch.tensor(token_ids)]
        if self.eagle3:
            x = torch.cat([self._norm(embeds, w[p + "input_layernorm.weight"]),
                           self._norm(features, w[p + "hidden_norm.weight"])], -1)
            residual = features
        else:
            x = torch.cat([embeds, features], -1) @ w["fc.weight"].T + w["fc.bias"]
            residual = x  # EAGLE (v1): no input norm
        n, heads, kv_heads = len(token_ids), cfg.num_attention_heads, cfg.num_key_value_heads
        d = cfg.hidden_size // heads
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k_ = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d).transpose(0, 1)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d).transpose(0, 1)
        cos, sin = self.rotary(x[None], torch.arange(n)[None])
        q, k_ = (t * cos[0] + self._rotate_half(t) * sin[0] for t in (q, k_))
        k_, v = (t.repeat_interleave(heads // kv_heads, 0) for t in (k_, v))
        scores = q @ k_.transpose(1, 2) / d ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), -1e30)
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d)
        x = residual + attn @ w[p + "self_attn.o_proj.weight"].T
        h = self._norm(x, w[p + "post_attention_layernorm.weight"])
        mlp = (torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T)
               * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return x + mlp

    def _greedy(self, hidden) -> int:
        if self.eagle3:
            logits = self._norm(hidden, self.w["norm.weight"]) @ self.w["lm_head.weight"].T
            draft = int(logits.argmax())
            return draft + int(self.w["d2t"][draft])
        return int((hidden @ self.target.lm_head.weight.T).argmax())

    def _norm(self, x, weight):
        return weight * x * self.torch.rsqrt((x * x).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)

    def _rotate_half(self, x):
        half = x.shape[-1] // 2
        return self.torch.cat([-x[..., half:], x[..., :half]], -1)


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory, tiny_llama_dir) -> dict:
    """method -> (target dir, head dir). EAGLE-3 reads three layers: an 8-layer target."""
    deep = dict(TINY_CONFIGS["llama"], num_hidden_layers=8)
    deep_dir = save_random_checkpoint(deep, str(tmp_path_factory.mktemp("tiny_llama8")), seed=7)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(deep_dir)
    return {"eagle": (tiny_llama_dir, save_eagle_head(
                str(tmp_path_factory.mktemp("eagle")), TINY_CONFIGS["llama"], False, 3)),
            "eagle3": (deep_dir, save_eagle_head(
                str(tmp_path_factory.mktemp("eagle3")), deep, True, 4)),
            "eagle3_layers": (deep_dir, save_eagle_head(  # the layers named by its config
                str(tmp_path_factory.mktemp("eagle3_layers")), deep, True, 6, [1, 5])),
            "eagle_accepting": (tiny_llama_dir, _accepting_head(
                str(tmp_path_factory.mktemp("eagle_accepting"))))}


def _accepting_head(out: str) -> str:
    """A head whose output is nearly its input feature (fc passes the feature, attention and
    MLP add little): it mostly drafts the target's last token again, so repeating text accepts
    some drafts and rejects others."""
    from safetensors.numpy import load_file, save_file

    cfg = TINY_CONFIGS["llama"]
    save_eagle_head(out, cfg, False, 5)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    h = cfg["hidden_size"]
    tensors["fc.weight"] = np.concatenate([0.05 * tensors["fc.weight"][:, :h], np.eye(h)],
                                          1).astype(np.float32)
    for name in ("fc.bias", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        tensors[name] *= 0.05
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


def eagle_llm(target_dir: str, head_dir: str, method: str = "eagle", **kwargs):
    return make_llm(target_dir, False, speculative_config=eagle_spec(head_dir, method),
                    **kwargs)


@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3_layers", "eagle_accepting"])
def test_drafts_equal_the_reference_after_every_step(head, eagle_dirs):
    """Prompts prefilled in chunks, then decode with verification: after every step each
    running request's drafts are the reference's for its tokens so far (with the accepting
    head, also after steps that accepted some drafts)."""
    target_dir, head_dir = eagle_dirs[head]
    method = head.split("_")[0]
    llm = eagle_llm(target_dir, head_dir, method, max_num_batched_tokens=16)
    engine, reference = llm.llm_engine, EagleReference(target_dir, head_dir, method == "eagle3")
    prompts = repetitive_prompts(30, 3) + [[5 + i for i in range(30)]]
    checked, full = drafts_checked_after_every_step(
        engine, prompts, lambda tokens, n: reference.drafts(tokens, K)[:n], K)
    assert checked >= 40 and full >= 0.6 * checked, (checked, full)
    if head == "eagle_accepting":
        stats = engine.get_stats()
        assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats[
            "spec_decode_num_draft_tokens_total"]


@pytest.fixture(scope="module")
def plain_llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, False, max_num_batched_tokens=32)


@pytest.mark.parametrize("kwargs", [None, {"num_gpu_blocks_override": 20},
                                    {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["plain", "preemption", "chunked_prefill"])
def test_greedy_equals_greedy_without_speculation(kwargs, eagle_dirs, plain_llm):
    prompts = repetitive_prompts(31, 6)
    expected = token_ids(plain_llm.generate(prompts, GREEDY, use_tqdm=False))
    llm = eagle_llm(*eagle_dirs["eagle_accepting"],
                    **(kwargs or {"max_num_batched_tokens": 32}))
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected
    stats = llm.llm_engine.get_stats()
    assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats[
        "spec_decode_num_draft_tokens_total"]
    if kwargs and "num_gpu_blocks_override" in kwargs:
        assert stats["num_preemptions_total"] > 0
    assert not llm.llm_engine.has_unfinished_requests()
    assert stats["num_free_blocks"] == llm.llm_engine.num_blocks - 1


def test_no_compilation_after_warmup(tiny_llama_dir, eagle_dirs):
    llm = eagle_llm(*eagle_dirs["eagle"], enforce_eager=False, max_num_batched_tokens=16)
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        llm.generate(repetitive_prompts(32, 6), mixed_params(random.Random(6), 6),
                     use_tqdm=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts_total"] > 0


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 2}, "method eagle is not supported with tensor, pipeline or data"),
    ({}, "not a local directory"),
])
def test_refusals(tiny_llama_dir, kwargs, match):
    head = "/nonexistent/eagle" if not kwargs else tiny_llama_dir
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=tiny_llama_dir, speculative_config=eagle_spec(head),
                   **kwargs).create_engine_config()


def test_head_reading_missing_layers_refused(tiny_llama_dir, tmp_path):
    head = save_eagle_head(str(tmp_path / "head"), TINY_CONFIGS["llama"], True, 0, [1, 9])
    with pytest.raises(ValueError, match=r"reads target layers \[1, 9\]; the target model "
                                         "has 2"):
        eagle_llm(tiny_llama_dir, head, "eagle3")


def test_head_of_another_width_refused(tiny_llama_dir, tmp_path):
    cfg = dict(TINY_CONFIGS["llama"], hidden_size=32)
    head = save_eagle_head(str(tmp_path / "head"), cfg, False, 0)
    with pytest.raises(ValueError, match="has hidden_size 32; the target model's is 64"):
        eagle_llm(tiny_llama_dir, head)
