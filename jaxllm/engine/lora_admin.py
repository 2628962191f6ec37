"""vLLM's add_lora / remove_lora / list_loras, over an engine's runner.lora (LoRASlots, or None
without LoRA): shared by the generation engine and the pooling engine."""

from __future__ import annotations

from jaxllm.lora.request import LoRARequest


class LoRAAdmin:
    """Mixed into an engine that has self.runner.lora."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter into host memory (a no-op when there); raises ValueError naming
        what is wrong with it, or that LoRA is not enabled."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} was requested, but LoRA "
                             "is not enabled: start the engine with enable_lora=True "
                             "(--enable-lora).")
        lora.host_cache.add(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drops an adapter from host memory and its device slot; requests running with it
        finish with it. False if it was not loaded."""
        lora = self.runner.lora
        if lora is None:
            return False
        lora.remove(lora_int_id)
        return lora.host_cache.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        lora = self.runner.lora
        return set() if lora is None else set(lora.host_cache.ids())
