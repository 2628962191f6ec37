"""HF-style config dicts of well-known models, for dummy-weight benchmarks (load_format="dummy")."""

from __future__ import annotations

_LLAMA_31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_LLAMA_31 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                 max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                 rope_scaling=_LLAMA_31_ROPE, tie_word_embeddings=False, bos_token_id=128000,
                 eos_token_id=[128001, 128008, 128009], attention_bias=False, mlp_bias=False)

_QWEN3 = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
              rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643,
              eos_token_id=151645, attention_bias=False, use_sliding_window=False)

_LLAMA_31_8B = dict(_LLAMA_31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8)

PRESETS: dict[str, dict] = {
    # The 8B's head_dim and query group at a size that starts in seconds (smoke tests).
    "llama-tiny": dict(_LLAMA_31, vocab_size=4096, hidden_size=1024, intermediate_size=2048,
                       num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
    "llama-3.1-8b": _LLAMA_31_8B,
    # The 8B as a static FP8 checkpoint (vLLM's fp8 format: per-tensor activation scales, as
    # NVIDIA's and Red Hat's FP8 releases of it): dummy FP8 weights, activation scales of 1.
    "llama-3.1-8b-fp8": dict(_LLAMA_31_8B, quantization_config=dict(
        quant_method="fp8", activation_scheme="static")),
    # Llama 3.2 1B: Llama 3's vocabulary, so a draft model for the 8B and 70B.
    "llama-3.2-1b": dict(_LLAMA_31, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA_31_ROPE, factor=32.0)),
    "llama-3.1-70b": dict(_LLAMA_31, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    "qwen3-8b": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8),
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral-8x7b": dict(architectures=["MixtralForCausalLM"], model_type="mixtral",
                         vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
