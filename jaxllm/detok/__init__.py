"""Host-side detokenisation and stop strings (no JAX)."""

from jaxllm.detok.detokenizer import IncrementalDetokenizer, find_stop_string

__all__ = ["IncrementalDetokenizer", "find_stop_string"]
