"""The suite's peer worker: the same workloads through HF transformers on torch (bf16, random
init from the same config): decode step at 2k context, static-batch `generate`, continuous-
batching `generate_batch`, output throughput against batch size. Run by gpu_suite.py."""

from __future__ import annotations

import os
import time

from suite_plan import Recorder, plan, worker_args, workload_name


def build_model(p: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(p["hf_config"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if p["dtype"] == "bfloat16" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval(), device


def _prompts(num: int, input_len: int, vocab_size: int, seed: int, device: str):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num, input_len), generator=gen).to(device)


def _generate_s(model, input_ids, new_tokens: int) -> float:
    """Seconds of one greedy static-batch generate of exactly new_tokens tokens."""
    import torch

    torch.cuda.synchronize() if input_ids.is_cuda else None
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    torch.cuda.synchronize() if input_ids.is_cuda else None
    if out.shape[1] != input_ids.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - input_ids.shape[1]} tokens, "
                           f"{new_tokens} were asked for.")
    return time.perf_counter() - start


def decode_item(model, device: str, batch: int, p: dict, vocab_size: int) -> dict:
    """Decode step time: (generate 1 + steps tokens - generate 1 token) / steps."""
    ids = _prompts(batch, p["context_len"], vocab_size, batch, device)
    _generate_s(model, ids[:, :16], 2)  # warm-up
    one = _generate_s(model, ids, 1)
    more = _generate_s(model, ids, 1 + p["hf_decode_steps"])
    step_ms = (more - one) / p["hf_decode_steps"] * 1e3
    return {"batch_size": batch, "context_len": p["context_len"], "median_step_ms": step_ms,
            "output_tokens_per_s": batch * 1e3 / step_ms}


def static_item(model, device: str, workload, p: dict, vocab_size: int) -> dict:
    input_len, output_len, num_prompts = workload
    num_prompts = min(num_prompts, p["hf_num_prompts"])
    batch = p["hf_static_batch"]
    ids = _prompts(num_prompts, input_len, vocab_size, 0, device)
    elapsed = sum(_generate_s(model, ids[i:i + batch], output_len)
                  for i in range(0, num_prompts, batch))
    return {"input_len": input_len, "output_len": output_len, "num_prompts": num_prompts,
            "batch_size": batch, "elapsed_time": elapsed,
            "output_tokens_per_second": num_prompts * output_len / elapsed,
            "tokens_per_second": num_prompts * (input_len + output_len) / elapsed}


def generate_batch_item(model, device: str, workload, p: dict, vocab_size: int) -> dict:
    from transformers import GenerationConfig

    input_len, output_len, num_prompts = workload
    num_prompts = min(num_prompts, p["hf_generate_batch_prompts"])
    inputs = _prompts(num_prompts, input_len, vocab_size, 1, "cpu").tolist()
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    return {"input_len": input_len, "output_len": output_len, "num_prompts": num_prompts,
            "elapsed_time": elapsed, "total_output_tokens": output_tokens,
            "output_tokens_per_second": output_tokens / elapsed}


def concurrency_item(model, device: str, batch: int, p: dict, vocab_size: int) -> dict:
    input_len, output_len = p["concurrency_workload"]
    ids = _prompts(batch, input_len, vocab_size, 2, device)
    elapsed = _generate_s(model, ids, output_len)
    return {"concurrency": batch, "elapsed_time": elapsed,
            "output_tokens_per_second": batch * output_len / elapsed}


def main() -> None:
    a = worker_args()

    import torch
    import transformers

    p = plan(a.smoke, a.scale, a.long)
    vocab = p["hf_config"]["vocab_size"]
    rec = Recorder(os.path.join(a.out, "hf.json"), a.deadline)
    holder = {}

    def build() -> dict:
        start = time.perf_counter()
        holder["model"], holder["device"] = build_model(p)
        return {"torch": torch.__version__, "transformers": transformers.__version__,
                "device": holder["device"], "build_s": time.perf_counter() - start,
                "has_generate_batch": hasattr(holder["model"], "generate_batch")}

    rec.run("env", build)
    if "model" not in holder:
        return
    model, device = holder["model"], holder["device"]
    for batch in p["hf_decode_batches"]:
        rec.run(f"decode_b{batch}", lambda b=batch: decode_item(model, device, b, p, vocab))
    for workload in p["throughput"]:
        rec.run(f"static_{workload_name(*workload[:2])}",
                lambda w=workload: static_item(model, device, w, p, vocab))
    if hasattr(model, "generate_batch"):
        first = p["throughput"][0]
        rec.run(f"generate_batch_{workload_name(*first[:2])}",
                lambda: generate_batch_item(model, device, first, p, vocab))
    for batch in p["hf_concurrency"]:
        rec.run(f"concurrency_{batch}",
                lambda b=batch: concurrency_item(model, device, b, p, vocab))


if __name__ == "__main__":
    main()
