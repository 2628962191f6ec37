"""LoRA adapters: the request type (request.py, importable without JAX), PEFT loading and
validation (peft.py), the host-side LRU (host_cache.py)."""
