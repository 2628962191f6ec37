"""One H200 call: what multi-LoRA costs on the Llama-3.1-8B shape (dummy bf16 weights, random
rank-16 adapters in PEFT's format on all seven projections), printed a row at a time and written
to OUT/lora_gpu.json and .md.

    python benchmarks/lora_gpu.py --out DIR          # one H200, about 6 minutes
    python benchmarks/lora_gpu.py --out DIR --cpu    # a tiny shape, to test the script anywhere

1. Batch-1 decode ms/step (1000-token context): LoRA off; LoRA on, base-model request; LoRA on,
   an adapter's request. Target: the adapter within 10% of LoRA off.
2. Offline 200 x 180 in / 1000 out: LoRA off; every request on the base model with LoRA on; the
   requests spread uniformly over 4 and over 16 adapters, loaded into host memory beforehand (as
   the server's --lora-modules are: the first try timed 16 disk reads of ~300 ms inside a ~15 s
   run), moved into device slots as requests need them. Target: 16 adapters >= 85% of LoRA off.
3. Time to load an adapter from disk into host memory, and to move one from host memory into a
   device slot (what a request for an adapter not on the device waits for; requests of adapters
   already in slots switch per token, at no cost).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from jaxllm import LLM, LoRARequest
from jaxllm.bench import roofline
from jaxllm.models.lora import module_shapes
from quant_gpu import PRESET, _tiny_llama_dir, decode_ms, throughput

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def save_dummy_adapter(path: str, args, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter (fp16) for a model of `args`, on every projection."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(args.num_layers):
        for target, (fan_in, fan_out) in module_shapes(args).items():
            key = (f"base_model.model.model.layers.{layer}."
                   f"{_PARENT.get(target, 'self_attn')}.{target}")
            tensors[f"{key}.lora_A.weight"] = (0.01 * rng.standard_normal((rank, fan_in))
                                               ).astype(np.float16)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((fan_out, rank))
                                               ).astype(np.float16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(TARGETS), "bias": "none"}, f)
    return path


def move_in_seconds(llm: LLM, lora: LoRARequest) -> tuple[float, float]:
    """(disk -> host memory, host memory -> a device slot) for an adapter on neither."""
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_lora(lora)
    disk = time.perf_counter() - start
    slots = engine.runner.lora
    busy = {0}
    slots.slot_for(lora, busy)
    return disk, slots.load_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny shape and workloads (a test)")
    parser.add_argument("--adapters-dir", default=None,
                        help="where the random adapters go (default: a temporary folder; 81 MB "
                             "each on the 8B, too many to return with the results)")
    cli = parser.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    if cli.cpu:
        model, context, steps, workload = _tiny_llama_dir(), 32, 4, (8, 16, 24)
        base = dict(model=model, max_model_len=256, max_num_seqs=8, enforce_eager=True)
    else:
        model, context, steps, workload = PRESET, 1000, 64, (200, 180, 1000)
        base = dict(model=model, load_format="dummy", dtype="bfloat16", max_model_len=2048)
    args = roofline.model_args_of(model, base.get("load_format", "auto"))
    adapters_dir = cli.adapters_dir or tempfile.mkdtemp(prefix="lora_gpu_")
    adapters = [LoRARequest(f"a{i}", i + 1, save_dummy_adapter(
        os.path.join(adapters_dir, f"a{i}"), args, 16, i)) for i in range(17)]
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    gc.collect()
    llm = LLM(**base)
    record(dict(test="batch-1 decode", config="LoRA off", ms_per_step=decode_ms(
        llm, context, steps)))
    record(dict(test="offline 200/180", config="LoRA off",
                output_tok_per_s=throughput(llm, *workload)))
    del llm
    gc.collect()
    llm = LLM(**base, enable_lora=True, max_loras=16, max_lora_rank=16, max_cpu_loras=17)
    for label, lora in (("LoRA on, base request", None), ("LoRA on, adapter", adapters[0])):
        record(dict(test="batch-1 decode", config=label,
                    ms_per_step=decode_ms(llm, context, steps, lora)))
    for label, loras in (("base only", ()), ("4 adapters", adapters[:4]),
                         ("16 adapters", adapters[:16])):
        for lora in loras:  # read from disk beforehand, as --lora-modules does at start-up
            llm.llm_engine.add_lora(lora)
        record(dict(test="offline 200/180", config=f"LoRA on, {label}",
                    output_tok_per_s=throughput(llm, *workload, loras=loras)))
    disk, slot = move_in_seconds(llm, adapters[16])
    record(dict(test="adapter load", disk_to_host_ms=1e3 * disk, host_to_slot_ms=1e3 * slot))
    _write(cli.out, rows)


def _write(out: str, rows: list[dict]) -> None:
    with open(os.path.join(out, "lora_gpu.json"), "w") as f:
        json.dump({"rows": rows}, f, indent=2)
    lines = ["| test | config | result |", "| --- | --- | --- |"]
    for r in rows:
        if "ms_per_step" in r:
            result = f"{r['ms_per_step']:.2f} ms/step"
        elif "output_tok_per_s" in r:
            result = f"{r['output_tok_per_s']:,.0f} output tok/s"
        else:
            result = (f"disk -> host {r['disk_to_host_ms']:.1f} ms, host -> device slot "
                      f"{r['host_to_slot_ms']:.2f} ms")
        lines.append(f"| {r['test']} | {r.get('config', '')} | {result} |")
    with open(os.path.join(out, "lora_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
