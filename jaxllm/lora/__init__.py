"""LoRA adapters: the request type, PEFT loading and validation, the host-side LRU."""

from jaxllm.lora.host_cache import HostLoRACache
from jaxllm.lora.peft import LORA_TARGETS, LoRAAdapter, load_peft_adapter
from jaxllm.lora.request import LoRARequest

__all__ = ["HostLoRACache", "LORA_TARGETS", "LoRAAdapter", "LoRARequest", "load_peft_adapter"]
