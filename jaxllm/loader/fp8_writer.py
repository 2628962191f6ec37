"""A pre-quantised FP8 checkpoint of a 16- or 32-bit one: every decoder linear (experts
included) as float8_e4m3fn with per-output-channel scales (vLLM's fp8 layout and
compressed-tensors' float8 channel scheme) or block-wise scales (`weight_block_size`, the layout
of Qwen3's and DeepSeek's FP8 releases), for tests and the accuracy table where no real FP8
checkpoint is at hand. `--activation-scheme static` adds each linear's static activation scale
(`input_scale`), calibrated on a text file by HF transformers' model (needs torch).

    python -m jaxllm.loader.fp8_writer MODEL_DIR OUT_DIR [--block 128 128]
    python -m jaxllm.loader.fp8_writer MODEL_DIR OUT_DIR --activation-scheme static \
        --calibration-file TEXT
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from jaxllm.loader.quant_checkpoint import block_scales, fp8_block_size
from jaxllm.loader.safetensors_io import iter_tensors, safetensors_files, write_checkpoint
from jaxllm.models.quant import FP8_MAX, MIN_SCALE


def quantize_blocks(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (float8 values [N, K], scale [cdiv(N, bn), cdiv(K, bk)]): each block's
    absolute max / 448 (the last blocks may be partial; block (1, K): per output channel)."""
    (n, k), (bn, bk) = w.shape, block
    padded = np.pad(np.abs(w.astype(np.float32)), ((0, -n % bn), (0, -k % bk)))
    amax = padded.reshape(padded.shape[0] // bn, bn, -1, bk).max(axis=(1, 3))
    scale = np.maximum(amax, MIN_SCALE) / FP8_MAX  # [Nb, Kb]
    full = np.asarray(block_scales(scale, block, (n, k)))
    values = np.clip(w.astype(np.float32) / full, -FP8_MAX, FP8_MAX)
    return values.astype(ml_dtypes.float8_e4m3fn), scale.astype(np.float32)


CALIBRATION_WINDOW = 512  # tokens a calibration forward


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def write_fp8(model_dir: str, out_dir: str, quantization_config: dict,
              extra_tensors: dict | None = None) -> str:
    """Writes OUT_DIR: the linears quantised as quantization_config says (block-wise where it
    names blocks: `weight_scale_inv` under fp8, `weight_scale` under compressed-tensors; else
    per channel, `weight_scale`), the other tensors as stored, extra_tensors added, the config
    with quantization_config, and the tokenizer and generation files copied."""
    block = fp8_block_size(quantization_config)
    scale_name = ("weight_scale_inv" if block and quantization_config.get("quant_method") == "fp8"
                  else "weight_scale")
    tensors = {}
    for path in safetensors_files(model_dir):
        for name, host in iter_tensors(path):
            if _is_linear(name):  # per channel: [N, 1] scales
                tensors[name], tensors[name.replace(".weight", f".{scale_name}")] = (
                    quantize_blocks(host, block or (1, host.shape[1])))
            else:
                tensors[name] = np.asarray(host)
    return write_checkpoint(model_dir, out_dir, {**tensors, **(extra_tensors or {})},
                            quantization_config)


def calibrated_input_scales(model_dir: str, prompts: list[list[int]]) -> dict[str, np.ndarray]:
    """Each decoder linear's static activation scale, `{linear}.input_scale` [] float32: the
    largest |x| its input takes over `prompts` (token ids) in HF transformers' float32 model,
    over 448 (a min-max calibration, llm-compressor's default observer). Needs torch."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    amax: dict[str, float] = {}

    def record(name, inputs):
        amax[name] = max(amax.get(name, 0.0), float(inputs[0].abs().max()))

    hooks = [module.register_forward_pre_hook(lambda m, a, name=name: record(name, a))
             for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and _is_linear(f"{name}.weight")]
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return {f"{name}.input_scale": np.asarray(max(a, MIN_SCALE) / FP8_MAX, np.float32)
            for name, a in amax.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--block", type=int, nargs=2, metavar=("N", "K"),
                        help="block-wise scales (weight_block_size); default: per channel")
    parser.add_argument("--activation-scheme", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--calibration-file", help="static: text to calibrate the scales on")
    args = parser.parse_args()
    config = {"quant_method": "fp8", "activation_scheme": args.activation_scheme}
    if args.block:
        config["weight_block_size"] = list(args.block)
    scales = None
    if args.activation_scheme == "static":
        if not args.calibration_file:
            parser.error("--activation-scheme static needs --calibration-file")
        from transformers import AutoTokenizer
        with open(args.calibration_file) as f:
            ids = AutoTokenizer.from_pretrained(args.model_dir)(f.read())["input_ids"]
        scales = calibrated_input_scales(args.model_dir, [ids[i:i + CALIBRATION_WINDOW] for i in
                                                          range(0, len(ids), CALIBRATION_WINDOW)])
    write_fp8(args.model_dir, args.out_dir, config, scales)


if __name__ == "__main__":
    main()
