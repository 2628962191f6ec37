"""Engine configuration: one frozen dataclass per concern, field names as vLLM's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

_DTYPES = ("auto", "bfloat16", "float16", "float32")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# vLLM's names. fp8 quantises a 16-bit checkpoint at load or reads an FP8 one; gptq and awq read
# 4-bit checkpoints (vLLM's marlin variants are the same checkpoints); compressed-tensors: its
# float8 schemes. jaxllm/models/quant.py has the layouts.
QUANTIZATION_METHODS = ("fp8", "gptq", "awq", "compressed-tensors", "modelopt")
_QUANTIZATION_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # the resolved model: an HF-layout directory, or a dummy preset name
    hf_config: dict = field(compare=False, repr=False)  # its config.json (or the preset)
    max_model_len: int = 2048  # validated against the model's max_position_embeddings
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    seed: int = 0
    tokenizer: str | None = None  # a directory; None: the model's
    served_model_name: str = DEFAULT_MODEL_NAME
    runner: str = "generate"  # generate | pooling (resolved from "auto" by EngineArgs)
    convert: str = "none"  # none | embed | classify: how a pooling runner uses the model
    # None: the checkpoint's own quantization_config.quant_method, if any (as vLLM)
    quantization: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "quantization",
                           resolve_quantization(self.quantization, self.hf_config))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        derived = self.hf_config.get("max_position_embeddings", 2048)
        if self.max_model_len > derived:
            raise ValueError(
                f"User-specified max_model_len ({self.max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={derived} in the model's config).")


def resolve_quantization(requested: str | None, hf_config: dict) -> str | None:
    """The method a model runs with: the one asked for, which must match the checkpoint's
    quantization_config when it has one (vLLM's errors)."""
    requested = _QUANTIZATION_ALIASES.get(requested, requested)
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"Unknown quantization method: {requested}. Must be one of "
                         f"{list(QUANTIZATION_METHODS)}.")
    checkpoint = (hf_config.get("quantization_config") or {}).get("quant_method")
    if checkpoint is None:
        if requested not in (None, "fp8"):
            raise ValueError(f"Quantization method {requested} needs a checkpoint quantized with "
                             f"it (a quantization_config with quant_method {requested!r} in "
                             f"config.json); only fp8 quantizes a 16-bit checkpoint at load.")
        return requested
    checkpoint = _QUANTIZATION_ALIASES.get(str(checkpoint).lower(), str(checkpoint).lower())
    if checkpoint not in QUANTIZATION_METHODS:
        raise ValueError(f"Unknown quantization method: {checkpoint} (the checkpoint's "
                         f"quantization_config). Must be one of {list(QUANTIZATION_METHODS)}.")
    if requested is not None and requested != checkpoint:
        raise ValueError(f"Quantization method specified in the model config ({checkpoint}) "
                         f"does not match the quantization method specified in the "
                         f"`quantization` argument ({requested}).")
    return checkpoint


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "auto"  # auto (the checkpoint's weights) | dummy (random weights)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}.")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    # The KV cache's bytes per device, instead of measuring what gpu_memory_utilization leaves
    # (vLLM's --kv-cache-memory-bytes); None: measured on a GPU, kv_cache.CPU_KV_CACHE_BYTES on
    # a CPU, which has no device memory to measure.
    kv_cache_memory_bytes: int | None = None
    # Reuse the KV of full blocks whose prefix was computed before (vLLM: on by default).
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"  # sha256 | xxhash (needs the xxhash package)
    # auto: the model's dtype; fp8 / fp8_e4m3: float8_e4m3fn pages, one static scale per tensor
    # (the checkpoint's per layer, else 1.0: vLLM's default without --calculate-kv-scales)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}.")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        if self.prefix_caching_hash_algo not in ("sha256", "xxhash"):
            raise ValueError("prefix_caching_hash_algo must be 'sha256' or 'xxhash', got "
                             f"{self.prefix_caching_hash_algo!r}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be at least 2, got {self.num_gpu_blocks_override}.")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or "
                f"equal to max_num_seqs ({self.max_num_seqs}).")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # Layers split into this many stages, each on its own TP devices (vLLM's
    # --pipeline-parallel-size; uneven splits from VLLM_PP_LAYER_PARTITION, sharding/pipeline.py).
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        sizes = (self.tensor_parallel_size, self.data_parallel_size, self.pipeline_parallel_size)
        if min(sizes) < 1:
            raise ValueError(
                "tensor_parallel_size, data_parallel_size and pipeline_parallel_size must be at "
                f"least 1, got {sizes[0]}, {sizes[1]} and {sizes[2]}.")

    @property
    def world_size(self) -> int:
        """Devices of the whole engine: DP x PP x TP."""
        return self.tensor_parallel_size * self.data_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class RunnerConfig:
    # auto: pallas on GPU, xla elsewhere | pallas (Triton; Mosaic GPU for prefill on Hopper) |
    # triton | mosaic (that Pallas kernel for every bucket) | xla
    attention_backend: str = "auto"
    compilation_cache_dir: str | None = "~/.cache/jaxllm/jit"  # None disables the persistent cache
    enforce_eager: bool = False  # skip warm-up (tests that do not care about compile time)
    # Launch step N+1 before fetching step N's tokens (vLLM's async scheduling), so the host's
    # work between steps overlaps the device's. Exact: tests/test_engine.py runs both.
    async_scheduling: bool = True
    # No lax.cond in a step (on a GPU each one stalls the host until the device reaches it):
    # three programs per bucket, "greedy" (every row greedy: the argmax alone), "plain" (no
    # penalties, no top-k/top-p, no logprobs) and "all", and prompt logprobs as a program of
    # their own. None: on a GPU only (a CPU runs a cond for free and its warm-up would triple).
    lean_steps: bool | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "pallas", "triton", "mosaic", "xla"):
            raise ValueError("attention_backend must be auto, pallas, triton, mosaic or xla, "
                             f"got {self.attention_backend!r}.")


POOLING_TYPES = ("CLS", "MEAN", "LAST", "ALL")


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's PoolerConfig: how a pooling model turns hidden states into its output. Fields left
    None take the model's defaults (sentence-transformers files, then the task's)."""
    pooling_type: str | None = None  # CLS | MEAN | LAST | ALL
    normalize: bool | None = None  # L2-normalise embeddings
    use_activation: bool | None = None  # softmax (sigmoid for one label) over class logits
    dimensions: int | None = None  # Matryoshka: default output size of embeddings

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got "
                             f"{self.pooling_type!r}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")


# -- speculative decoding (vLLM's --speculative-config) ---------------------------------------
IMPLEMENTED_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# vLLM's methods that jaxllm refuses by name until they land (docs/design.md).
NOT_IMPLEMENTED_METHODS = ("mtp", "medusa", "mlp_speculator", "suffix")
# Speculation stops for a step whose running batch has at least this many requests: past it a
# verification step costs more than typical acceptance saves (benchmarks/spec_decode_gpu.py
# measures the cost per batch size; docs/design.md has the figures).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model (draft_model, eagle, eagle3)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix n-gram to match
    prompt_lookup_max: int | None = None  # ngram: longest
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft_model: the draft's resolved config (EngineArgs builds it, not the JSON)
    draft_model_config: ModelConfig | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.method in NOT_IMPLEMENTED_METHODS:
            raise ValueError(f"Speculative decoding method {self.method!r} is not supported by "
                             f"jaxllm yet; supported: {', '.join(IMPLEMENTED_METHODS)}.")
        if self.method not in IMPLEMENTED_METHODS:
            raise ValueError(f"Unknown speculative decoding method {self.method!r}; supported: "
                             f"{', '.join(IMPLEMENTED_METHODS)}.")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1, got "
                             f"{self.num_speculative_tokens}.")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1, got "
                             f"{self.disable_by_batch_size}.")
        if self.method == "ngram":
            self._check_prompt_lookup()
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f"speculative_config needs 'model' for method {self.method}.")

    def _check_prompt_lookup(self) -> None:
        if self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be > 0")
        if self.prompt_lookup_max < 1:
            raise ValueError(f"prompt_lookup_max={self.prompt_lookup_max} must be > 0")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, values: dict | str) -> "SpeculativeConfig":
        """From --speculative-config's JSON (or LLM(speculative_config={...})). As vLLM: the
        method defaults to ngram when model is "ngram", and the n-gram bounds default to each
        other, or both to 5."""
        if isinstance(values, str):
            try:
                values = json.loads(values)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(values, dict):
            raise ValueError("speculative_config must be a JSON object, got "
                             f"{type(values).__name__}.")
        values = dict(values)
        known = {f.name for f in fields(cls)} - {"draft_model_config"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config does not support {', '.join(unknown)}; "
                             f"supported keys: {', '.join(sorted(known))}.")
        if values.get("method") is None and values.get("model") == "ngram":
            values["method"], values["model"] = "ngram", None
        for key in ("method", "num_speculative_tokens"):
            if values.get(key) is None:
                raise ValueError(f"speculative_config needs {key!r}.")
        if values["method"] == "ngram":
            low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            values["prompt_lookup_min"] = low if low is not None else (high or 5)
            values["prompt_lookup_max"] = high if high is not None else (low or 5)
        if values.get("disable_by_batch_size") is None:
            values.pop("disable_by_batch_size", None)
        return cls(**values)


# vLLM's choices for --max-lora-rank
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's --enable-lora and its knobs): max_loras device slots of rank
    max_lora_rank (slot 0 of the stacks is "no adapter"), and up to max_cpu_loras adapters kept
    in host memory."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras ({self.max_loras}) must be at least 1.")
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be one of "
                             f"{list(LORA_RANKS)}.")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")


@dataclass(frozen=True)
class EngineConfig:
    """Every concern's config, built and validated once before loading and passed down (vLLM's
    VllmConfig)."""
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    load_config: LoadConfig
    runner_config: RunnerConfig
    pooler_config: PoolerConfig | None = None  # set exactly when model_config.runner is pooling
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None  # set exactly when LoRA is enabled
