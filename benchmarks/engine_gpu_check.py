"""One GPU call: is the engine right on the GPU, and where does a decode step's time go?

    python benchmarks/engine_gpu_check.py --out DIR

1. A random Llama, and with --hf-models also a random Qwen3-MoE (the MoE layer's Pallas grouped
   matmul; --tensor-parallel-size / --data-parallel-size / --enable-expert-parallel lay it over
   several GPUs), HF-saved here, through the engine with Pallas attention against HF
   transformers' greedy decoding on the GPU, token for token (fp32; bf16 agreement).
2. The Llama-3.1-8B shape (dummy bf16): decode step time at 2k context for batch 1/8/64 against
   the bandwidth floor, with the host's share of each step (schedule, batch build + launch,
   wait for the device, scheduler update + outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import numpy as np


_HF_CONFIGS = {  # head_dim 128, GQA group 3
    "llama": dict(intermediate_size=1536, architectures=["LlamaForCausalLM"]),
    "qwen3_moe": dict(intermediate_size=1536, moe_intermediate_size=256, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True,
                      architectures=["Qwen3MoeForCausalLM"]),
}


def check_vs_hf(out: dict, async_scheduling: bool, kind: str = "llama", **parallel) -> None:
    """A random model of `kind` (_HF_CONFIGS) saved by HF on this machine: our engine with the
    Pallas kernels (fp32; mixed prefill/decode through a small token budget; `parallel`: engine
    TP/DP/EP flags) against HF's greedy decoding on the GPU, token for token. (The default
    model's GGUF is too large to carry to the GPU machine.)"""
    import sys
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import build_tiny_tokenizer

    from jaxllm import LLM, SamplingParams

    config = AutoConfig.for_model(
        kind, vocab_size=384, hidden_size=768, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
        **_HF_CONFIGS[kind])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, int(n)).tolist() for n in (5, 40, 130, 300, 17, 600)]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            new = []
            for _ in range(24):
                logits = model(torch.tensor([ids + new]).to(device)).logits[0, -1]
                logits[2] = -float("inf")
                new.append(int(logits.argmax()))
            expected.append(new)
    del model
    torch.cuda.empty_cache()
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, dtype=dtype, max_model_len=1024, max_num_seqs=8,
                  max_num_batched_tokens=128, enforce_eager=True, gpu_memory_utilization=0.3,
                  async_scheduling=async_scheduling, **parallel)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        same = [sum(a == b for a, b in zip(g, e)) for g, e in zip(got, expected)]
        out[f"hf_match_{kind}_{dtype}"] = {"exact": [g == e for g, e in zip(got, expected)],
                                            "same_tokens_of_24": same, **parallel}
        del llm
    print(json.dumps(out, indent=1), flush=True)


def instrument(engine) -> dict:
    """Wraps the stages of EngineCore.step with timers; returns the dict they add to."""
    spent = defaultdict(float)

    def timed(obj, name, key):
        fn = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "launch", "build + launch")
    timed(engine.runner, "collect", "wait for device (+ fetch)")
    timed(engine.scheduler, "update_from_output", "scheduler update")
    timed(engine.output_processor, "process", "outputs (detok)")
    return spent


def decode_8b(out: dict, async_scheduling: bool) -> None:
    from jaxllm import LLM
    from jaxllm.bench import roofline
    from jaxllm.bench.latency import measure_decode_step

    ceilings = roofline.measure_ceilings()
    out["ceilings"] = vars(ceilings) if hasattr(ceilings, "__dict__") else str(ceilings)
    start = time.perf_counter()
    llm = LLM("llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=64, max_num_batched_tokens=2048, enforce_eager=True,
              num_gpu_blocks_override=20000, async_scheduling=async_scheduling)
    out["load_s"] = time.perf_counter() - start
    engine = llm.llm_engine
    args = engine.runner  # noqa: F841 (keeps the runner alive in tracebacks)
    model_args = roofline.model_args_of("llama-3.1-8b", "dummy")
    for batch in (1, 8, 64):
        measure_decode_step(engine, batch, 2048, 5)  # compile this bucket
        spent = instrument(engine)
        result = measure_decode_step(engine, batch, 2048, 40)
        floor = roofline.decode_step_floor(model_args, batch, 2048 + 20, ceilings)
        result["floor_ms"] = floor["floor_s"] * 1e3
        result["fraction_of_floor"] = result["floor_ms"] / result["median_step_ms"]
        result["host_breakdown_ms_total"] = dict(spent)
        out[f"decode_b{batch}"] = result
        print(json.dumps(result, indent=1), flush=True)
        for obj in (engine.scheduler, engine.runner, engine.output_processor):
            for name in ("schedule", "launch", "collect", "update_from_output", "process"):
                obj.__dict__.pop(name, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--hf-models", nargs="+", default=["llama"], choices=sorted(_HF_CONFIGS))
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--skip-8b", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--pallas-kv-write", action="store_true",
                        help="the engine writes K/V with the Pallas kernel, not the scatter")
    a = parser.parse_args()
    if a.pallas_kv_write:
        from pallas_kernels import kv_write  # the A/B: the engine takes write_kv when built
        kv_write.write_kv = kv_write.write_kv_pallas
    os.makedirs(a.out, exist_ok=True)
    out: dict = {}
    try:
        parallel = dict(tensor_parallel_size=a.tensor_parallel_size,
                        data_parallel_size=a.data_parallel_size,
                        enable_expert_parallel=a.enable_expert_parallel)
        for kind in [] if a.skip_hf else a.hf_models:
            try:
                check_vs_hf(out, a.async_scheduling, kind, **parallel)
            except Exception as e:  # keep going to the next model and the 8B part
                out[f"hf_check_error_{kind}"] = repr(e)
                print(f"HF check of {kind} failed:", repr(e), flush=True)
        if not a.skip_8b:
            decode_8b(out, a.async_scheduling)
    finally:
        with open(os.path.join(a.out, "engine_gpu_check.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
    for batch in (1, 8, 64):
        r = out.get(f"decode_b{batch}")
        if r:
            print(f"b={batch:3d}  step {r['median_step_ms']:.2f} ms  floor {r['floor_ms']:.2f} ms  "
                  f"{100 * r['fraction_of_floor']:.0f}% of floor")
    print({k: v for k, v in out.items() if k.startswith("hf_")})


if __name__ == "__main__":
    main()
