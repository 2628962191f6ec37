"""One GPU call on one H200: what speculative decoding costs and saves.

~5 min for 1-3; 4 builds two more engines (--parts picks what one call runs).

    python benchmarks/spec_decode_gpu.py --out DIR          # H200: llama-3.1-8b, dummy bf16
    python benchmarks/spec_decode_gpu.py --out DIR --cpu    # the logic, on the default model

1. Verification cost: engine steps in which every sequence verifies k = 1, 2, 4, 8 drafts,
   against steps that decode one token (k = 0), at batch 1, 8 and 32 and 512 tokens of context,
   on one engine. The drafts are the last token repeated (rejected by dummy weights), so each
   step costs a full (k + 1)-token verification. Decides disable_by_batch_size: speculation pays
   at batch B while step_ms(k) / step_ms(0) stays below the mean acceptance length expected.
2. Batch-1 time per output token (TPOT), greedy, 256 tokens: plain decode, against k = 4 drafts
   from a replay proposer that proposes the tokens plain decode produced (every draft is
   accepted up to numerical differences: the upper bound of the mechanism, what a perfect
   draft model or a fully repeating text gives), and against n-gram drafts (k = 4, prompt
   lookup 1..3; with dummy weights the acceptance is whatever the model's loops give, printed
   beside). The default model's GGUF does not travel to the GPU machine, hence dummy weights.
3. Throughput at 256 concurrent requests (512 in, 128 out, sampled): speculation off against
   n-gram k = 4 with the default disable_by_batch_size (speculation switches itself off while
   the batch is large).
4. Batch-1 TPOT with a draft model (method draft_model, k = 4), against plain decode of (2):
   llama-3.2-1b (dummy bf16, Llama 3's vocabulary; its drafts are unrelated to the target's
   dummy weights, so nearly all are rejected: what drafting costs), and the target as its own
   draft (the same dummy weights: every draft accepted up to bf16 near ties, the mechanism's
   upper bound with the cost of an 8B draft: a step reads the weights k + 2 times for up to
   k + 1 tokens). With --cpu the default model is its own draft.
5. Batch-1 TPOT with an EAGLE head (k = 4, drafting on device after each step), random heads in
   the public layout for the target's shape: a random one (its drafts are rejected: what EAGLE's
   drafting costs per step) and a near-identity one (it drafts the last token again: accepted
   where the dummy model's greedy text repeats).
Writes DIR/spec_decode_gpu.json and prints one line per measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import time

import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.bench.spec_decode import spec_decode_metrics
from jaxllm.config import DEFAULT_DISABLE_BY_BATCH_SIZE
from jaxllm.loader.loader import resolve_model_path
from jaxllm.spec_decode.proposer import PerRequestProposer

KS = (1, 2, 4, 8)


class FixedDrafts(PerRequestProposer):
    """Proposes the last token k times: a verification of k drafts every step."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, token_ids: list[int]) -> list[int]:
        return token_ids[-1:] * self.k


class ReplayDrafts(PerRequestProposer):
    """Proposes what plain greedy decoding produced after the same tokens."""

    def __init__(self, k: int, prompt: list[int], expected: list[int]) -> None:
        self.k, self.full = k, prompt + expected

    def propose(self, token_ids: list[int]) -> list[int]:
        n = len(token_ids)
        return self.full[n:n + self.k] if self.full[:n] == token_ids else []


def make_llm(args, speculative: dict | None, **kwargs) -> LLM:
    engine = dict(model=args.model, load_format=args.load_format, max_model_len=4096,
                  max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
                  gpu_memory_utilization=0.85, speculative_config=speculative,
                  enforce_eager=args.cpu)
    return LLM(**{**engine, **kwargs})


def release_memory() -> None:
    """After the last reference to an engine is dropped: its device buffers go once the cycles
    frozen at start-up (the builder's gc.freeze) are collectable again."""
    gc.unfreeze()
    gc.collect()


def step_times(llm: LLM, batch: int, context: int, proposers: dict, steps: int) -> dict:
    """Median engine-step ms with each proposer, every sequence decoding throughout."""
    engine = llm.llm_engine
    rng = np.random.default_rng(batch)
    # enough for every step to accept all its drafts (dummy weights may repeat a token)
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=len(proposers) * (steps + 2) * (max(KS) + 1) + 8)
    ids = [f"steps-{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(0, 1000, context).tolist(), params)
    result = {}
    try:
        while engine.scheduler.num_waiting or any(
                r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()
        for name, proposer in proposers.items():
            engine.proposer = proposer
            engine.step()
            engine.step()  # drafts proposed after a step are verified in the next
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            result[name] = float(np.median(times) * 1e3)
        if engine.scheduler.num_running != batch:
            raise RuntimeError(f"only {engine.scheduler.num_running} of {batch} sequences ran")
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return result


def tpot(llm: LLM, prompt: list[int], num_tokens: int) -> tuple[float, list[int]]:
    """ms per output token after the first, batch 1, greedy; and the tokens."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=num_tokens)
    engine, times, tokens = llm.llm_engine, [], []
    engine.add_request("tpot", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            times.append(time.perf_counter())
            tokens = out.outputs[0].token_ids
    return (times[-1] - times[0]) * 1e3 / max(len(tokens) - 1, 1), list(tokens)


def throughput(llm: LLM, num_requests: int, input_len: int, output_len: int) -> float:
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 1000, input_len).tolist()}
               for _ in range(num_requests)]
    params = SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=output_len)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def acceptance(llm: LLM, before: dict) -> dict | None:
    stats = llm.llm_engine.get_stats()
    delta = {k: (v - before.get(k, 0) if not isinstance(v, list)
                 else [a - b for a, b in zip(v, before.get(k, [0] * len(v)))])
             for k, v in stats.items() if k.startswith("spec_decode")}
    return spec_decode_metrics(delta)


def run(args) -> dict:
    results: dict = {"model": args.model, "batches": args.batches, "ks": KS}
    prompt = np.random.default_rng(7).integers(0, 1000, 64).tolist()
    expected = run_plain(args, prompt, results)
    release_memory()
    if args.parts & {"verify", "tpot", "throughput"}:
        run_ngram(args, prompt, expected, results)
        release_memory()
    for name, draft in args.drafts.items() if args.parts & {"draft_model", "draft_self"} else ():
        if "draft_model" not in args.parts and name != "self":
            continue
        run_draft_model(args, name, draft, prompt, expected, results)
        release_memory()
    for name in ("random", "identity") if "eagle" in args.parts else ():
        run_eagle(args, name, prompt, expected, results)
        release_memory()
    return results


def save_eagle_head(out_dir: str, hf_config: dict, identity: bool, seed: int = 0) -> str:
    """A random EAGLE (v1) head for a target of hf_config, in the public checkpoints' layout
    (fp16 safetensors); identity: fc passes the feature on and attention and MLP add nothing,
    so the head drafts the target's last token again."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]
    d = hf_config.get("head_dim") or h // heads
    q, kv = heads * d, (hf_config.get("num_key_value_heads") or heads) * d
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter)}
    tensors = {f"layers.0.{name}": (0.02 * rng.standard_normal(shape, np.float32)
                                    ).astype(np.float16) for name, shape in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = np.ones(h, np.float16)
    fc = 0.02 * rng.standard_normal((h, 2 * h), np.float32)
    if identity:
        fc[:, :h], fc[:, h:] = 0, np.eye(h)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            tensors[f"layers.0.{name}"][:] = 0
    tensors["fc.weight"] = fc.astype(np.float16)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**hf_config, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1},
                  f)
    return out_dir


def run_eagle(args, name: str, prompt: list[int], expected: list[int], results: dict) -> None:
    """Batch-1 TPOT with k = 4 EAGLE drafts from a random head of the target's shape."""
    import tempfile

    from jaxllm.loader.loader import read_hf_config

    hf_config = read_hf_config(resolve_model_path(args.model, args.load_format),
                               args.load_format)
    head = save_eagle_head(tempfile.mkdtemp(prefix=f"eagle_{name}_"), hf_config,
                           name == "identity")
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 4}
    llm = make_llm(args, spec, max_num_seqs=8, max_num_batched_tokens=512)
    tpot(llm, prompt, 8)  # --cpu runs eager: its first steps compile
    tpot_with_drafts(llm, f"eagle_{name}", prompt, expected, args.tpot_tokens, results)


def run_plain(args, prompt: list[int], results: dict) -> list[int]:
    """Plain engine: batch-1 TPOT (its tokens feed the replay proposer), throughput off."""
    llm = make_llm(args, None)
    tpot(llm, prompt, 8)  # its first steps may compile (--cpu runs eager)
    results["tpot_plain_ms"], expected = tpot(llm, prompt, args.tpot_tokens)
    print(f"batch-1 TPOT, plain: {results['tpot_plain_ms']:.2f} ms", flush=True)
    if "throughput" in args.parts:
        results["throughput_off"] = throughput(llm, args.num_requests, 512, 128)
        print(f"throughput, speculation off: {results['throughput_off']:.0f} output tok/s",
              flush=True)
    return expected


def run_ngram(args, prompt: list[int], expected: list[int], results: dict) -> None:
    """Speculating engine: up to 8 drafts for up to 32 sequences."""
    spec = {"method": "ngram", "num_speculative_tokens": max(KS), "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": max(args.batches) + 1}
    llm = make_llm(args, spec)
    engine = llm.llm_engine
    ngram = engine.proposer
    ngram.k = 4
    results["verify_ms"] = {}
    for batch in args.batches if "verify" in args.parts else ():
        times = step_times(llm, batch, 512, {0: FixedDrafts(0), **{k: FixedDrafts(k) for k in KS}},
                           args.steps)
        results["verify_ms"][batch] = times
        print(f"batch {batch}: step ms " + ", ".join(
            f"k={k} {ms:.2f} ({ms / times[0]:.2f}x)" for k, ms in times.items()), flush=True)
    for name, proposer in ((("replay", ReplayDrafts(4, prompt, expected)), ("ngram", ngram))
                           if "tpot" in args.parts else ()):
        engine.proposer = proposer
        tpot_with_drafts(llm, name, prompt, expected, args.tpot_tokens, results)
    engine.proposer = ngram
    if "throughput" not in args.parts:
        return
    engine.scheduler.speculative_config = dataclasses.replace(
        engine.scheduler.speculative_config, disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE)
    results["throughput_on"] = throughput(llm, args.num_requests, 512, 128)
    print(f"throughput, n-gram k=4 (disable_by_batch_size {DEFAULT_DISABLE_BY_BATCH_SIZE}): "
          f"{results['throughput_on']:.0f} output tok/s "
          f"({results['throughput_on'] / results['throughput_off']:.3f} of off)", flush=True)


def run_draft_model(args, name: str, draft: str, prompt: list[int], expected: list[int],
                    results: dict) -> None:
    """Batch-1 TPOT with k = 4 drafts from a draft model, drafted on device after each step (an
    engine of a few buckets: only batch 1 runs)."""
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4}
    llm = make_llm(args, spec, max_num_seqs=8, max_num_batched_tokens=512)
    tpot(llm, prompt, 8)  # --cpu runs eager: its first steps compile
    tpot_with_drafts(llm, f"draft_{name}", prompt, expected, args.tpot_tokens, results)


def tpot_with_drafts(llm: LLM, name: str, prompt: list[int], expected: list[int],
                     num_tokens: int, results: dict) -> None:
    before = llm.llm_engine.get_stats()
    ms, tokens = tpot(llm, prompt, num_tokens)
    results[f"tpot_{name}_ms"] = ms
    results[f"tpot_{name}_acceptance"] = acceptance(llm, before)
    results[f"tpot_{name}_same_tokens"] = tokens == expected
    acc = results[f"tpot_{name}_acceptance"] or {}
    print(f"batch-1 TPOT, {name} drafts: {ms:.2f} ms ({results['tpot_plain_ms'] / ms:.2f}x "
          f"faster), mean acceptance length {acc.get('mean_acceptance_length', 0):.2f}, "
          f"same tokens as plain: {tokens == expected}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true",
                        help="the default model (real weights), small sizes: test the logic")
    parser.add_argument("--parts", default="ngram,draft_model,eagle",
                        help="which of verify (1), tpot (2), throughput (3), ngram (1-3), "
                             "draft_model (4), draft_self (4, the target as its own draft "
                             "only) and eagle (5) to run, beside plain decode")
    args = parser.parse_args()
    args.parts = set(args.parts.split(","))
    if "ngram" in args.parts:
        args.parts |= {"verify", "tpot", "throughput"}
    if args.cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.model, args.load_format, args.max_num_batched_tokens = None, "auto", 512
        args.batches, args.steps, args.tpot_tokens, args.num_requests = [1, 4], 3, 24, 16
        args.drafts = {"self": resolve_model_path(None)}
    else:
        args.model, args.load_format, args.max_num_batched_tokens = "llama-3.1-8b", "dummy", 2048
        args.batches, args.steps, args.tpot_tokens, args.num_requests = [1, 8, 32], 10, 256, 256
        args.drafts = {"1b": "llama-3.2-1b", "self": args.model}
    os.makedirs(args.out, exist_ok=True)
    results = run(args)
    with open(os.path.join(args.out, "spec_decode_gpu.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
