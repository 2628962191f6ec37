"""PEFT LoRA adapters for tests: random adapters saved by PEFT itself, and PEFT's merged weights
as the reference (plain functions; conftest's fixtures call them)."""

from __future__ import annotations


def save_random_peft_adapter(base_model_dir: str, out_dir: str, *, rank: int, target_modules,
                             lora_alpha: float, use_rslora: bool = False, seed: int = 0,
                             rank_pattern: dict | None = None,
                             alpha_pattern: dict | None = None, scale: float = 0.1,
                             model_class=None) -> str:
    """Wraps the HF model in `base_model_dir` (fp32; model_class, default the causal LM) with
    PEFT's LoraConfig, sets every lora_A and lora_B to seeded random values times `scale` (PEFT
    starts B at zero, which would make the adapter a no-op) and saves the adapter with PEFT's
    save_pretrained."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = (model_class or AutoModelForCausalLM).from_pretrained(base_model_dir,
                                                                  dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=target_modules,
                        use_rslora=use_rslora, rank_pattern=rank_pattern or {},
                        alpha_pattern=alpha_pattern or {}, lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(scale * torch.randn(param.shape, generator=gen))
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_merged_weights(base_model_dir: str, adapter_dir: str) -> dict:
    """HF name -> the weight (numpy, HF's [out, in]) after PEFT's merge_and_unload: the reference
    for W + A @ B."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return {name: t.detach().numpy().copy() for name, t in merged.state_dict().items()}
