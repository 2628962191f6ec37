"""One H200 call: what quantisation buys on the Llama-3.1-8B shape (dummy weights), printed a row
at a time (and to OUT/rows.jsonl as it goes) and written to OUT/quant_gpu.json and .md.

    python benchmarks/quant_gpu.py --out DIR          # one H200, about 6 minutes
    python benchmarks/quant_gpu.py --out DIR --cpu    # a tiny shape, to test the script anywhere

1. Batch-1 decode ms/step (1000-token context) and % of its own bandwidth floor for bf16,
   fp8 weights and int4 weights (random packed 4-bit weights, group 128: the GPTQ/AWQ compute
   path, no checkpoint needed). Targets: fp8 <= 2.3 ms; int4 >= 75% of its floor.
2. Offline 1000 prompts x 1000 in / 1000 out, fp8 weights + fp8 KV cache, at max_num_seqs 256
   and 512 (the FP8 cache holds 512 such sequences). Target >= 17,744 output tok/s
   (TensorRT-LLM, Llama-3.1-8B FP8, one H200: NVIDIA's published perf overview).
3. Offline 200 x 180 in / 1000 out, fp8 weights. Target >= 22,000 output tok/s.
4. KV cache blocks with each cache dtype (bf16 vs fp8) at the same memory settings.
--tests picks some of batch1, 1000/1000, 1000/1000@512 (the 512-sequence run), 200/180 (default:
all; the offline ones each in a call of their own under a 10-minute limit).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import LLM, SamplingParams
from jaxllm.bench import roofline
from jaxllm.models.layer_stacks import stack_layers
from jaxllm.models.quant import QUANTIZED_NAMES, Int4Weight

PRESET = "llama-3.1-8b"
TESTS = ("batch1", "1000/1000", "1000/1000@512", "200/180")
BATCH1_WEIGHTS = ("bf16", "fp8", "int4")


def random_int4_weight(key, w, group: int = 128) -> Int4Weight:
    """Random packed 4-bit weights (GPTQ without act order) standing for w's [K, *out] shape."""
    k, out = w.shape[0], w.shape[1:]
    kp = -(-k // 128) * 128
    qweight = jax.random.bits(key, (kp // 8, *out), jnp.uint32).view(jnp.int32)
    scales = jnp.full((kp // group, *out), 2e-3, w.dtype)
    zeros = jnp.full((kp // group, *out), 8, jnp.uint8)
    return Int4Weight(qweight, scales, zeros, None, k)


def random_int4(params: dict, group: int = 128) -> dict:
    """The engine's params with every projection replaced by random packed 4-bit weights of its
    shape (the 16-bit matrices freed)."""
    key = jax.random.key(0)
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for name in QUANTIZED_NAMES:
            if name in layer:
                key, sub = jax.random.split(key)
                w = layer[name]
                layer[name] = random_int4_weight(sub, w, group)
                w.delete()
        layers.append(layer)
    out = {**params, "layers": layers}
    return stack_layers(out) if "layer_stacks" in params else out  # as the engine stacks


def use_random_int4(engine) -> None:
    """The engine's weights replaced by random_int4's, with the one-token bucket (the int4
    GEMV's) that the builder gives an int4 checkpoint but did not give these bf16 weights."""
    runner = engine.runner
    runner.params = random_int4(runner.params)
    if runner.buckets[0] != 1:
        runner.buckets = [1] + runner.buckets


def weight_bytes(args, kind: str) -> float:
    """A batch-1 step's weight bytes: projections at 2 / 1 / ~0.52 bytes (int4 with its bf16
    scales and uint8 zeros per group of 128), embedding row and LM head at 2."""
    quantization = {"bf16": None, "fp8": "fp8", "int4": "gptq"}[kind]
    return roofline.weight_bytes_per_step(args, 1, roofline.Storage.of(2, quantization))


def decode_ms(llm: LLM, context: int, steps: int, lora_request=None) -> float:
    """ms per decode step at batch 1: (time of 1 + steps tokens - time of 1 token) / steps."""
    high = min(1000, llm.input_processor.vocab_size)
    prompt = {"prompt_token_ids": list(np.random.default_rng(0).integers(10, high, context))}
    def run(n):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                     use_tqdm=False, lora_request=lora_request)
        return time.perf_counter() - start
    run(steps + 1)  # warm (eager programs compile here)
    return 1e3 * (min(run(steps + 1) for _ in range(2)) - min(run(1) for _ in range(2))) / steps


def throughput(llm: LLM, num: int, input_len: int, output_len: int, loras=()) -> float:
    """Output tok/s offline; loras: LoRA requests the prompts take in turn (none: the base)."""
    rng = np.random.default_rng(1)
    high = min(30000, llm.input_processor.vocab_size)
    prompts = [{"prompt_token_ids": rng.integers(10, high, input_len).tolist()}
               for _ in range(num)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    lora_requests = [loras[i % len(loras)] for i in range(num)] if loras else None
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny shape and workloads (a test)")
    parser.add_argument("--tests", nargs="+", choices=TESTS, default=TESTS)
    parser.add_argument("--batch1-weights", nargs="+", choices=BATCH1_WEIGHTS,
                        default=BATCH1_WEIGHTS, help="the weights batch1 measures")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    if cli.cpu:
        model, scale = _tiny_llama_dir(), dict(context=64, steps=4, big=(8, 32, 16),
                                               mid=(8, 16, 16))
        base = dict(model=model, max_model_len=256, max_num_seqs=8, enforce_eager=True)
    else:
        model, scale = PRESET, dict(context=1000, steps=64, big=(1000, 1000, 1000),
                                    mid=(200, 180, 1000))
        base = dict(model=model, load_format="dummy", dtype="bfloat16", max_model_len=2048)
    args = roofline.model_args_of(model, base.get("load_format", "auto"))
    ceilings = roofline.measure_ceilings("bfloat16")
    rows = []

    def record(row):  # also appended to rows.jsonl at once: a later crash keeps it
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(cli.out, "rows.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    def build(**kw):
        gc.collect()
        return LLM(**{**base, **kw})

    batch1 = [(kind, {"quantization": "fp8"} if kind == "fp8" else {})
              for kind in BATCH1_WEIGHTS if kind in cli.batch1_weights]  # bf16 first, as ever
    for kind, kw in batch1 if "batch1" in cli.tests else ():
        llm = build(max_num_seqs=1, enforce_eager=kind == "int4" or cli.cpu, **kw)
        if kind == "int4":
            use_random_int4(llm.llm_engine)
        ms = decode_ms(llm, scale["context"], scale["steps"])
        kv = scale["context"] * roofline.kv_bytes_per_token(args)
        floor_ms = 1e3 * (weight_bytes(args, kind) + kv) / ceilings.hbm_bytes_per_s
        record(dict(test="batch-1 decode", weights=kind, ms_per_step=ms, floor_ms=floor_ms,
                    pct_of_floor=100 * floor_ms / ms, kv_blocks=llm.llm_engine.num_blocks))
        del llm
    both = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    for label, workload, kw in (
            ("1000/1000", scale["big"], both),
            ("1000/1000@512", scale["big"], {**both, "max_num_seqs": 16 if cli.cpu else 512}),
            ("200/180", scale["mid"], {"quantization": "fp8"})):
        if label not in cli.tests:
            continue
        llm = build(**kw)
        record(dict(test=f"offline {label}", config=kw, output_tok_per_s=throughput(
            llm, *workload), kv_blocks=llm.llm_engine.num_blocks))
        del llm
    _write(cli.out, rows, ceilings)


def _write(out: str, rows: list[dict], ceilings) -> None:
    with open(os.path.join(out, "quant_gpu.json"), "w") as f:
        json.dump({"ceilings": ceilings.as_dict(), "rows": rows}, f, indent=2)
    lines = ["| test | config | result | KV blocks |", "| --- | --- | --- | --- |"]
    for r in rows:
        if "ms_per_step" in r:
            result = (f"{r['ms_per_step']:.2f} ms/step, {r['pct_of_floor']:.1f}% of its floor "
                      f"({r['floor_ms']:.2f} ms)")
            config = f"{r['weights']} weights"
        else:
            result, config = f"{r['output_tok_per_s']:,.0f} output tok/s", json.dumps(r["config"])
        lines.append(f"| {r['test']} | {config} | {result} | {r['kv_blocks']} |")
    with open(os.path.join(out, "quant_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def _tiny_llama_dir() -> str:
    """A tiny random Llama (hidden 128) saved by HF, for --cpu."""
    import sys
    import tempfile
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import TINY_CONFIGS, build_tiny_tokenizer, save_random_checkpoint
    config = dict(TINY_CONFIGS["llama"], hidden_size=128, intermediate_size=256)
    return save_random_checkpoint(config, tempfile.mkdtemp(), build_tiny_tokenizer())


if __name__ == "__main__":
    main()
