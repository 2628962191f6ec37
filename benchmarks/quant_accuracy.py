"""What each quantisation costs on a real model: perplexity over a fixed corpus and agreement of
greedy outputs with the 16-bit model, for bf16, FP8 weights, FP8 KV cache, both, a block-wise
FP8 checkpoint (128 x 128 scales, as Qwen3's FP8 releases; jaxllm/loader/fp8_writer.py), a
static FP8 checkpoint (per-channel weights, per-tensor activation scales calibrated on
benchmarks/data/quant_calibration.txt, a text apart from the corpus) and int4 (a GPTQ-format
checkpoint this script writes by RTN, jaxllm/loader/gptq_writer.py).

    python benchmarks/quant_accuracy.py [--model DIR] [--out docs/lab/...md]

Default model: SmolLM2-135M-Instruct (`LLM()`'s). Runs on a CPU (XLA emulates the FP8 dots and
casts exactly as the GPU rounds them; the numbers are the formats', not the kernels' speed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import tempfile
import time

from jaxllm import LLM, SamplingParams
from jaxllm.loader.default_model import default_model_dir
from jaxllm.loader.fp8_writer import calibrated_input_scales, write_fp8
from jaxllm.loader.gptq_writer import write_rtn_gptq

CORPUS = os.path.join(os.path.dirname(__file__), "data", "quant_corpus.txt")
CALIBRATION = os.path.join(os.path.dirname(__file__), "data", "quant_calibration.txt")
WINDOW = 512  # tokens per perplexity window (each window scored on its own)
PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.", "List three uses of copper.",
    "Once upon a time, in a small village by the mountains,", "The theory of relativity says",
    "How do I boil an egg?", "def fibonacci(n):", "The three primary colours are",
    "Translate to French: Good morning, how are you?", "Why is the sky blue?",
    "A recipe for pancakes:", "The largest planet in the solar system is",
    "Summarise the plot of Romeo and Juliet.", "In 1969, the first humans", "Water boils at",
]
NUM_TOKENS = 32
CONFIGS = {  # name -> (checkpoint: a key of main's checkpoints, EngineArgs fields)
    "bf16": ("base", {}),
    "fp8 weights": ("base", {"quantization": "fp8"}),
    "fp8 KV cache": ("base", {"kv_cache_dtype": "fp8"}),
    "fp8 weights + KV": ("base", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
    "fp8 block-wise checkpoint (128 x 128)": ("fp8_block", {}),
    "the same, dequantised to bf16": ("fp8_block_bf16", {}),
    "fp8 static checkpoint (calibrated)": ("fp8_static", {}),
    "the same + fp8 KV": ("fp8_static", {"kv_cache_dtype": "fp8"}),
    "int4 RTN (GPTQ, g64)": ("int4", {}),
}


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    windows = [token_ids[i:i + WINDOW] for i in range(0, len(token_ids), WINDOW)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            total += entry[token].logprob
            count += 1
    return math.exp(-total / count)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def agreement(outputs, reference) -> tuple[int, float]:
    """(prompts whose tokens all agree, mean number of leading tokens that agree)."""
    prefix = []
    for got, want in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        prefix.append(same)
    return sum(p == NUM_TOKENS for p in prefix), sum(prefix) / len(prefix)


def dequantized_copy(fp8_dir: str, block: tuple[int, int]) -> str:
    """fp8_dir's block-wise linears dequantised to bf16 (the checkpoint's own rounding alone,
    without jaxllm's per-channel requantisation), as a 16-bit checkpoint."""
    import ml_dtypes
    import numpy as np

    from jaxllm.loader.quant_checkpoint import dequantize_blocks
    from jaxllm.loader.safetensors_io import iter_tensors, write_checkpoint

    tensors = dict(iter_tensors(os.path.join(fp8_dir, "model.safetensors")))
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight = name.replace("_scale_inv", "")
        w = np.asarray(dequantize_blocks(tensors[weight], tensors.pop(name), block))
        tensors[weight] = w.astype(ml_dtypes.bfloat16)
    return write_checkpoint(fp8_dir, tempfile.mkdtemp(prefix="fp8_block_bf16_"), tensors, None)


def static_checkpoint(base: str) -> str:
    """base as a static FP8 checkpoint, its activation scales calibrated on CALIBRATION in
    windows of WINDOW tokens."""
    from transformers import AutoTokenizer
    with open(CALIBRATION) as f:
        ids = AutoTokenizer.from_pretrained(base)(f.read())["input_ids"]
    scales = calibrated_input_scales(base, [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW)])
    return write_fp8(base, tempfile.mkdtemp(prefix="fp8_static_"),
                     {"quant_method": "fp8", "activation_scheme": "static"}, scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF directory (default: SmolLM2-135M)")
    parser.add_argument("--out", default=None, help="write the markdown table here")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = parser.parse_args()
    base = args.model or default_model_dir()
    block_dir = functools.cache(lambda: write_fp8(
        base, tempfile.mkdtemp(prefix="fp8_block_"),
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}))
    checkpoints = {"base": lambda: base, "fp8_block": block_dir,
                   "fp8_block_bf16": lambda: dequantized_copy(block_dir(), (128, 128)),
                   "fp8_static": functools.cache(lambda: static_checkpoint(base)),
                   "int4": lambda: write_rtn_gptq(base, tempfile.mkdtemp(prefix="rtn_gptq_"),
                                                  group_size=64)}
    corpus_ids = None
    rows, reference = [], None
    for name in args.configs:
        checkpoint, extra = CONFIGS[name]
        start = time.time()
        llm = LLM(checkpoints[checkpoint](), dtype="bfloat16",
                  enforce_eager=True, max_num_seqs=16, max_model_len=WINDOW + NUM_TOKENS + 64,
                  **extra)
        if corpus_ids is None:
            with open(CORPUS) as f:
                corpus_ids = llm.get_tokenizer()(f.read())["input_ids"]
        ppl = perplexity(llm, corpus_ids)
        outputs = greedy(llm)
        reference = reference or outputs
        full, mean_prefix = agreement(outputs, reference)
        rows.append(dict(config=name, perplexity=ppl, agree=full, mean_prefix=mean_prefix,
                         seconds=time.time() - start))
        print(json.dumps(rows[-1]), flush=True)
        del llm
        gc.collect()
    table = [f"Corpus: {os.path.relpath(CORPUS)} ({len(corpus_ids)} tokens, windows of "
             f"{WINDOW}); greedy: {len(PROMPTS)} prompts x {NUM_TOKENS} tokens against "
             f"{args.configs[0]}.", "",
             "| config | perplexity | prompts identical | mean tokens before divergence |",
             "| --- | --- | --- | --- |"]
    table += [f"| {r['config']} | {r['perplexity']:.3f} | {r['agree']}/{len(PROMPTS)} | "
              f"{r['mean_prefix']:.1f} / {NUM_TOKENS} |" for r in rows]
    print("\n".join(table))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
