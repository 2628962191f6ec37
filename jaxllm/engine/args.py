"""EngineArgs: the flat, vLLM-named knobs of LLM(...), `jaxllm serve` and `jaxllm bench`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import jax

from jaxllm.config import (DEFAULT_MODEL_NAME, CacheConfig, EngineConfig, LoadConfig, ModelConfig,
                           ParallelConfig, RunnerConfig, SchedulerConfig)
from jaxllm.loader.loader import read_hf_config, resolve_model_path


@dataclass
class EngineArgs:
    model: str | None = None  # None: the built-in default model (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 256
    # None: max(2048, max_num_seqs) on GPU; max(512, max_num_seqs) on CPU, where compiling the
    # larger token buckets of an unrolled model takes minutes
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    seed: int = 0
    load_format: str = "auto"
    attention_backend: str = "auto"
    compilation_cache_dir: str | None = "~/.cache/jaxllm/jit"
    enforce_eager: bool = False
    served_model_name: str | None = None
    async_scheduling: bool = True
    lean_steps: bool | None = None  # None: on a GPU (RunnerConfig)

    def create_engine_config(self) -> EngineConfig:
        """Resolves the model (the default model and GGUF files are converted once into the
        cache), reads its config and validates every setting: before any weight is loaded."""
        model_path = resolve_model_path(self.model, self.load_format)
        hf_config = read_hf_config(model_path, self.load_format)
        max_model_len = self.max_model_len or hf_config.get("max_position_embeddings", 2048)
        default_tokens = 2048 if jax.default_backend() == "gpu" else 512
        max_num_batched_tokens = self.max_num_batched_tokens or max(default_tokens,
                                                                    self.max_num_seqs)
        return EngineConfig(
            model_config=ModelConfig(
                model=model_path, hf_config=hf_config, max_model_len=max_model_len,
                dtype=self.dtype, seed=self.seed, tokenizer=self.tokenizer,
                served_model_name=self.served_model_name or self.model or DEFAULT_MODEL_NAME),
            cache_config=CacheConfig(
                block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cpu_kv_cache_bytes=self.cpu_kv_cache_bytes),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel),
            load_config=LoadConfig(load_format=self.load_format),
            runner_config=RunnerConfig(
                attention_backend=self.attention_backend,
                compilation_cache_dir=self.compilation_cache_dir,
                enforce_eager=self.enforce_eager, async_scheduling=self.async_scheduling,
                lean_steps=self.lean_steps))

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """--max-model-len style flags for every field but `model` (a positional in the CLI)."""
        for f in fields(EngineArgs):
            if f.name == "model":
                continue
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool", "bool | None"):  # --enforce-eager / --no-enforce-eager
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            else:
                kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
                parser.add_argument(flag, type=kind, default=f.default)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
