"""Quantised models with tensor parallelism on two GPUs: TP=2 against TP=1, printed a row at a
time and written to OUT/quant_tp_gpu.json.

    python benchmarks/quant_tp_gpu.py --out DIR          # two H200s, a few minutes
    python benchmarks/quant_tp_gpu.py --out DIR --cpu    # tiny shapes on 2 simulated CPU devices

1. Agreement: a random Llama checkpoint (fp32, so TP changes only the order of partial sums)
   with FP8 weights quantised at load, FP8 weights + FP8 KV cache, and RTN GPTQ checkpoints
   with and without act order; greedy tokens of 8 prompts x 32 at TP=2 against TP=1 (prompts
   whose tokens all agree, and the largest logprob difference while they agree). On the GPU this
   runs the int4 Pallas kernel per device and the FP8 GEMM split by GSPMD.
2. Batch-1 decode ms/step on the Llama-3.1-8B shape (dummy weights, bf16) with FP8 weights at
   TP=1 and TP=2.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

CPU = "--cpu" in sys.argv
if CPU:  # before jax starts
    os.environ.update(JAX_PLATFORMS="cpu",
                      XLA_FLAGS="--xla_force_host_platform_device_count=2")

import numpy as np  # noqa: E402

from jaxllm import LLM, SamplingParams  # noqa: E402
from jaxllm.loader.gptq_writer import write_rtn_gptq  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))
from quant_gpu import decode_ms  # noqa: E402

NUM_PROMPTS, OUTPUT_LEN = 8, 32


def _checkpoint(cpu: bool) -> str:
    """A random Llama saved by HF: group 128 divides o_proj's and down_proj's rows at TP=2."""
    from conftest import TINY_CONFIGS, build_tiny_tokenizer, save_random_checkpoint
    shape = (dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2) if cpu else
             dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
                  num_key_value_heads=4, num_hidden_layers=4))
    return save_random_checkpoint(dict(TINY_CONFIGS["llama"], **shape), tempfile.mkdtemp(),
                                  build_tiny_tokenizer())


def _greedy(model: str, **kwargs) -> list[list[tuple[int, float]]]:
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, n).tolist()}
               for n in rng.integers(4, 60, NUM_PROMPTS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True, logprobs=0)
    llm = LLM(model, dtype="float32", max_model_len=128, enforce_eager=True, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    del llm
    gc.collect()
    return [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outs]


def _agreement(one: list, two: list) -> dict:
    same, max_diff = 0, 0.0
    for a, b in zip(one, two):
        same += [t for t, _ in a] == [t for t, _ in b]
        for (ta, la), (tb, lb) in zip(a, b):
            if ta != tb:
                break
            max_diff = max(max_diff, abs(la - lb))
    return dict(prompts_equal=f"{same}/{len(one)}", max_logprob_diff=max_diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes, 2 simulated devices")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    base = _checkpoint(cli.cpu)
    gptq = {act: write_rtn_gptq(base, tempfile.mkdtemp(), group_size=128, desc_act=act)
            for act in (False, True)}
    for name, model, kw in (("fp8", base, dict(quantization="fp8")),
                            ("fp8 + fp8 KV", base, dict(quantization="fp8", kv_cache_dtype="fp8")),
                            ("gptq", gptq[False], {}), ("gptq act order", gptq[True], {})):
        one, two = _greedy(model, **kw), _greedy(model, tensor_parallel_size=2, **kw)
        record(dict(test="TP=2 vs TP=1 greedy", config=name, **_agreement(one, two)))
    if not cli.cpu:
        for tp in (1, 2):
            llm = LLM("llama-3.1-8b", load_format="dummy", dtype="bfloat16", max_model_len=2048,
                      max_num_seqs=1, quantization="fp8", tensor_parallel_size=tp)
            record(dict(test="batch-1 decode, llama-3.1-8b fp8", tp=tp,
                        ms_per_step=decode_ms(llm, 1000, 64)))
            del llm
            gc.collect()
    with open(os.path.join(cli.out, "quant_tp_gpu.json"), "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
