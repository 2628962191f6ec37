"""What the single-GPU suite runs (shared by gpu_suite.py and its two workers), and the
section runner that records each item's result or error and saves after every item."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)

# Issue targets: decode fraction of the floor, offline output tokens/s.
DECODE_TARGETS = {1: 0.90, 8: 0.85, 64: 0.85}
THROUGHPUT_TARGETS = {"200x180": 13000.0, "1024x128": 4000.0, "1000x1000": 12000.0}


def plan(smoke: bool, scale: float, long: bool) -> dict:
    """Workloads as (input_len, output_len, num_prompts); num_prompts scaled by `scale`."""
    def n(count: int) -> int:
        return max(int(count * scale), 1)

    if smoke:
        return dict(model="tiny", hf_config=TINY_LLAMA, dtype="float32", max_model_len=512,
                    max_num_seqs=8, max_num_batched_tokens=64, context_len=64, decode_steps=8,
                    decode_batches=[1, 2], throughput=[(20, 12, n(16)), (48, 8, n(16))],
                    concurrency=[1, 4], concurrency_workload=(20, 12),
                    hf_static_batch=4, hf_num_prompts=n(8), hf_generate_batch_prompts=n(8),
                    hf_concurrency=[1, 4], hf_decode_batches=[1], hf_decode_steps=4)
    from jaxllm.models.presets import PRESETS

    throughput = [(200, 180, n(1000)), (1024, 128, n(1000))]
    if long:
        throughput.append((1000, 1000, n(1000)))
    return dict(model="llama-3.1-8b", hf_config=PRESETS["llama-3.1-8b"], dtype="bfloat16",
                max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048,
                context_len=2048, decode_steps=32, decode_batches=[1, 8, 64],
                throughput=throughput, concurrency=[1, 4, 16, 64, 256],
                concurrency_workload=(200, 180), hf_static_batch=64, hf_num_prompts=n(128),
                hf_generate_batch_prompts=n(256), hf_concurrency=[1, 8, 64, 256],
                hf_decode_batches=[1, 8, 64], hf_decode_steps=16)


def worker_args() -> argparse.Namespace:
    """The command line gpu_suite.py passes to each worker."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--deadline", type=float, required=True)
    return parser.parse_args()


def workload_name(input_len: int, output_len: int) -> str:
    return f"{input_len}x{output_len}"


class Recorder:
    """results[name] = fn() or {"error": ...}; saved to `path` after every item; items after
    `deadline` (epoch seconds) are recorded as skipped."""

    def __init__(self, path: str, deadline: float) -> None:
        self.path, self.deadline, self.results = path, deadline, {}

    def run(self, name: str, fn) -> dict | None:
        if time.time() > self.deadline:
            self.results[name] = {"skipped": "time budget spent"}
            print(f"[{name}] skipped: time budget spent", flush=True)
            self.save()
            return None
        print(f"[{name}] start", flush=True)
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - record it and go on with the next item
            result = {"error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()[-3000:]}
            print(f"[{name}] FAILED: {result['error']}", flush=True)
        result["wall_s"] = time.perf_counter() - start
        self.results[name] = result
        print(f"[{name}] done in {result['wall_s']:.1f}s: {_scalars(result)}", flush=True)
        self.save()
        return result

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        os.replace(tmp, self.path)


def _scalars(result: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in result.items()
                     if isinstance(v, (int, float, str)) and k not in ("traceback", "wall_s"))
