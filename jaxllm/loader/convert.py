"""`jaxllm convert MODEL OUT`: a model loaded as LLM(model) would load it, saved once as an Orbax
checkpoint that later starts restore straight into their mesh's shardings."""

from __future__ import annotations

from jaxllm.loader.loader import load_model
from jaxllm.loader.orbax_ckpt import save_checkpoint


def convert(model: str | None, out_dir: str, dtype: str = "auto") -> str:
    """Loads `model` (converted, dequantised) and writes the checkpoint to out_dir; returns it."""
    return save_checkpoint(load_model(model, dtype), out_dir)
