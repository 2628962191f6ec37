"""LoRARequest: which adapter a request runs with (vLLM's vllm.lora.request.LoRARequest)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, unique integer id (>= 1; 0 means "no adapter" in the batch) and the
    directory of its PEFT files."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def per_prompt(lora_request: LoRARequest | list | tuple | None, num_prompts: int) -> list:
    """The offline API's lora_request (one adapter or None for every prompt, or one per prompt)
    as one entry per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    lora_request = list(lora_request)
    if len(lora_request) != num_prompts:
        raise ValueError(f"The lengths of prompts ({num_prompts}) and lora_request "
                         f"({len(lora_request)}) must be the same.")
    return lora_request
