"""Reading safetensors files as memory-mapped numpy arrays, bfloat16 included.

safetensors' own numpy API rejects bfloat16 (numpy has no such dtype), so we read the format
directly: an 8-byte little-endian header length, a JSON header, then the raw tensor bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: those named by model.safetensors.index.json, else *.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"No *.safetensors weights found in {model_dir}.")
    return [os.path.join(model_dir, n) for n in names]


def read_header(path: str) -> tuple[dict, int]:
    """-> ({name: {dtype, shape, data_offsets}}, offset of the data section)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header, 8 + header_len


def iter_tensors(path: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, read-only memory-mapped array) for every tensor in one file."""
    header, data_start = read_header(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}.")
        begin, end = info["data_offsets"]
        raw = blob[data_start + begin:data_start + end]
        yield name, raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def count_tensors(paths: list[str]) -> int:
    return sum(len(read_header(p)[0]) for p in paths)


def write_checkpoint(model_dir: str, out_dir: str, tensors: dict[str, np.ndarray],
                     quantization_config: dict | None) -> str:
    """out_dir as model_dir with `tensors` for its weights (one model.safetensors), its config's
    quantization_config replaced (None: removed), and its other files (tokenizer, generation
    config) copied: the checkpoint writers' common part."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy(path, out_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
