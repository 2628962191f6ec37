"""A pre-quantised FP8 checkpoint of a 16- or 32-bit one: every decoder linear (experts
included) as float8_e4m3fn with per-output-channel scales (vLLM's fp8 layout and
compressed-tensors' float8 channel scheme) or block-wise scales (`weight_block_size`, the layout
of Qwen3's and DeepSeek's FP8 releases), for tests and the accuracy table where no real FP8
checkpoint is at hand.

    python -m jaxllm.loader.fp8_writer MODEL_DIR OUT_DIR [--block 128 128]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--block", type=int, nargs=2, metavar=("N", "K"),
                        help="block-wise scales (weight_block_size); default: per channel")
    args = parser.parse_args()
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if args.block:
        config["weight_block_size"] = list(args.block)
    write_fp8(args.model_dir, args.out_dir, config)


if __name__ == "__main__":
    main()
