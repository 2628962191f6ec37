"""Weights onto device: HF safetensors directories, dummy presets, GGUF import, the default model."""

from jaxllm.loader.loader import LoadedModel, load_model, resolve_dtype

__all__ = ["LoadedModel", "load_model", "resolve_dtype"]
