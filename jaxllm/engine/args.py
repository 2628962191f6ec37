"""EngineArgs: the flat, vLLM-named knobs of LLM(...), `jaxllm serve` and `jaxllm bench`."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
from dataclasses import dataclass, fields, replace

import jax

from jaxllm.config import (DEFAULT_MODEL_NAME, CacheConfig, EngineConfig, LoadConfig, ModelConfig,
                           LoRAConfig, ParallelConfig, PoolerConfig, RunnerConfig,
                           SchedulerConfig, SpeculativeConfig)
from jaxllm.core.kv_cache_utils import HASH_ALGOS, get_hash_fn
from jaxllm.engine.pooling_config import (pooling_max_model_len, resolve_pooler_config,
                                          resolve_runner)
from jaxllm.loader.loader import read_hf_config, resolve_model_path
from jaxllm.worker import device_memory
from jaxllm.loader import quant_checkpoint
from jaxllm.models import ModelArgs
from jaxllm.sharding.pipeline import layer_partition


@dataclass
class EngineArgs:
    model: str | None = None  # None: the built-in default model (SmolLM2-135M-Instruct)
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    # None: max(2048, max_num_seqs) on GPU, 32768 for pooling models (vLLM's defaults: a pooling
    # step has no decodes to keep fast); max(512, max_num_seqs) on CPU, where compiling the
    # larger token buckets of an unrolled model takes minutes
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    seed: int = 0
    load_format: str = "auto"
    attention_backend: str = "auto"
    compilation_cache_dir: str | None = "~/.cache/jaxllm/jit"
    enforce_eager: bool = False
    served_model_name: str | None = None
    async_scheduling: bool = True
    lean_steps: bool | None = None  # None: on a GPU (RunnerConfig)
    runner: str = "auto"  # auto | generate | pooling (auto: from the model's architectures)
    convert: str = "auto"  # auto | none | embed | classify (a pooling runner's task)
    pooler_config: PoolerConfig | dict | str | None = None  # a dict or its JSON on the CLI
    quantization: str | None = None  # fp8 | gptq | awq | compressed-tensors (vLLM's -q)
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3
    # vLLM's JSON (a dict offline): {"method": "ngram", "num_speculative_tokens": k, ...}
    speculative_config: dict | str | None = None
    enable_lora: bool = False
    max_loras: int = 1  # adapters a step can mix (device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras

    def create_engine_config(self) -> EngineConfig:
        """Resolves the model (the default model and GGUF files are converted once into the
        cache), reads its config and validates every setting: before any weight is loaded. First
        of all it sizes jax's GPU pool from gpu_memory_utilization and chooses its allocator,
        before jax's backend starts."""
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        device_memory.size_allocator_pool(self.gpu_memory_utilization)
        device_memory.choose_allocator(
            self.tensor_parallel_size * self.data_parallel_size * self.pipeline_parallel_size)
        get_hash_fn(self.prefix_caching_hash_algo)  # an unknown or uninstalled one fails now
        model_config, pooler_config = self._model_config()
        speculative = self._speculative_config(model_config)
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
                prefix_caching_hash_algo=self.prefix_caching_hash_algo,
                kv_cache_dtype=self.kv_cache_dtype),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=(self.max_num_batched_tokens
                                        or max(_default_batched_tokens(pooler_config),
                                               self.max_num_seqs)),
                max_model_len=model_config.max_model_len),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                pipeline_parallel_size=self.pipeline_parallel_size),
            load_config=LoadConfig(load_format=self.load_format),
            runner_config=RunnerConfig(
                attention_backend=self.attention_backend,
                compilation_cache_dir=self.compilation_cache_dir,
                enforce_eager=self.enforce_eager,
                async_scheduling=self.async_scheduling,
                lean_steps=self.lean_steps),
            pooler_config=pooler_config, speculative_config=speculative,
            lora_config=self._lora_config(model_config))
        _check_quantization(config)
        _check_pipeline_parallel(config)
        return config

    def _model_config(self) -> tuple[ModelConfig, PoolerConfig | None]:
        """The resolved model, its runner and, for a pooling model, its pooler."""
        model_path = resolve_model_path(self.model, self.load_format)
        hf_config = read_hf_config(model_path, self.load_format)
        runner, convert = resolve_runner(hf_config, self.runner, self.convert)
        pooler_config = (resolve_pooler_config(model_path, hf_config, convert,
                                               _as_pooler_config(self.pooler_config))
                         if runner == "pooling" else None)
        max_model_len = self.max_model_len or (
            pooling_max_model_len(model_path, hf_config) if pooler_config
            else hf_config.get("max_position_embeddings", 2048))
        return ModelConfig(
            model=model_path, hf_config=hf_config, max_model_len=max_model_len,
            dtype=self.dtype, seed=self.seed, tokenizer=self.tokenizer,
            served_model_name=self.served_model_name or self.model or DEFAULT_MODEL_NAME,
            runner=runner, convert=convert, quantization=self.quantization), pooler_config

    def _lora_config(self, model_config: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if (self.tensor_parallel_size > 1 or self.data_parallel_size > 1
                or self.pipeline_parallel_size > 1):
            raise ValueError("LoRA with tensor, data or pipeline parallelism (size > 1) is not "
                             "supported yet.")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras)

    def _speculative_config(self, target: ModelConfig) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        if self.data_parallel_size > 1 and self.enable_expert_parallel:
            raise ValueError("Speculative decoding with data parallel attention "
                             "(--enable-expert-parallel and data_parallel_size > 1) is not "
                             "supported yet.")
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if spec.method != "ngram":
            self._check_drafter(spec)
        if spec.method != "draft_model":
            return spec
        return replace(spec, draft_model_config=self._draft_model_config(spec, target))

    def _check_drafter(self, spec: SpeculativeConfig) -> None:
        """A drafter (EAGLE head, draft model) runs on one device beside the target (its KV
        under the target's block tables); an EAGLE head's checkpoint is read when the engine is
        built."""
        sizes = (self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size)
        if max(sizes) > 1:
            raise ValueError(f"Speculative decoding with method {spec.method} is not supported "
                             "with tensor, pipeline or data parallelism (size > 1) yet (got "
                             f"{', '.join(map(str, sizes))}).")
        if spec.method != "draft_model" and not os.path.isdir(spec.model):
            raise ValueError(f"The {spec.method} head {spec.model!r} is not a local directory "
                             "(an HF-format checkpoint: config.json and its weights).")

    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
        """The draft model, loaded as the target (load_format, dtype, seed, max_model_len): read
        and checked before any weight is loaded."""
        path = resolve_model_path(spec.model, self.load_format)
        hf_config = read_hf_config(path, self.load_format)
        target_vocab, draft_vocab = target.hf_config.get("vocab_size"), hf_config.get("vocab_size")
        if target_vocab != draft_vocab:
            raise ValueError(
                "Target and draft model should have the same vocabulary size. Target model "
                f"vocab_size={target_vocab}. Draft model vocab_size={draft_vocab}. The draft's "
                "tokens are the target's: a draft needs the target's tokenizer.")
        try:
            return ModelConfig(model=path, hf_config=hf_config, max_model_len=target.max_model_len,
                               dtype=target.dtype, seed=target.seed,
                               served_model_name=spec.model)
        except ValueError as error:
            raise ValueError(f"Draft model {spec.model!r}: {error}") from None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """vLLM's engine flags, spelt and parsed as vLLM's (aliases such as -tp, sizes such as 4k,
        --dtype half), one per field but `model` (a positional in the CLI); vLLM engine flags that
        jaxllm does not implement are refused by name, and those that change nothing here are
        accepted."""
        for f in fields(EngineArgs):
            if f.name != "model":
                parser.add_argument(f"--{f.name.replace('_', '-')}", *_ALIASES.get(f.name, ()),
                                    **_flag_options(f))
        add_vllm_compat_flags(parser, ENGINE_FLAGS_NO_EFFECT, ENGINE_FLAGS_DEFAULT_ONLY,
                              ENGINE_FLAGS_NOT_IMPLEMENTED)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if isinstance(values.get("served_model_name"), list):
            # The engine reports the first name; the server accepts all of them (server/cli.py).
            values["served_model_name"] = values["served_model_name"][0]
        return cls(**values)


def _as_pooler_config(value: PoolerConfig | dict | str | None) -> PoolerConfig | None:
    """--pooler-config '{"pooling_type": "MEAN"}' (vLLM's JSON), a dict, or a PoolerConfig."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"pooler_config is not valid JSON: {error}") from None
    try:
        return PoolerConfig(**value)
    except TypeError as error:
        raise ValueError(f"Invalid pooler_config: {error}") from None


def _default_batched_tokens(pooler_config: PoolerConfig | None) -> int:
    if jax.default_backend() != "gpu":
        return 512
    return 2048 if pooler_config is None else 32768


def _check_quantization(config: EngineConfig) -> None:
    """A quantization method or KV cache dtype the model or the GPU cannot run is refused here,
    before loading."""
    model = config.model_config
    if model.quantization is not None:
        quant_checkpoint.check_supported(model.quantization, model.hf_config,
                                         ModelArgs.from_hf_config(model.hf_config),
                                         config.parallel_config.tensor_parallel_size)
    if config.load_config.load_format == "dummy":
        quant_checkpoint.check_dummy(model.quantization, model.hf_config)
    quant_checkpoint.check_device(model.quantization, config.cache_config.kv_cache_dtype)


def _check_pipeline_parallel(config: EngineConfig) -> None:
    """What pipeline parallelism does not run with yet is refused before loading; the layer
    split (VLLM_PP_LAYER_PARTITION) is checked here too."""
    pp = config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return
    unsupported = [name for name, used in (
        ("speculative decoding", config.speculative_config is not None),
        ("quantization", config.model_config.quantization is not None),
        ("pooling models", config.model_config.runner == "pooling")) if used]
    if unsupported:
        raise ValueError(f"Pipeline parallelism (pipeline_parallel_size={pp}) does not support "
                         f"{' or '.join(unsupported)} yet.")
    layer_partition(ModelArgs.from_hf_config(config.model_config.hf_config).num_layers, pp)


# -- vLLM's value syntax ------------------------------------------------------------------------
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def human_readable_int(value: str) -> int:
    """vLLM's sizes: lower-case k m g t are powers of 1000 (4k = 4000, 25.6k = 25600), upper-case
    K M G T powers of 1024 (32K = 32768, whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}")
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        hint = f"; did you mean {number}{suffix.lower()}?" if suffix else ""
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}{hint}")
    return int(number) * _BINARY_SUFFIXES.get(suffix, 1)


def parse_max_model_len(value: str) -> int:
    if value.strip() in ("auto", "-1"):
        raise argparse.ArgumentTypeError(
            "jaxllm does not support --max-model-len auto (the longest that fits in memory) yet: "
            "give a length, or leave the flag out for the model's own limit")
    return human_readable_int(value)


def parse_dtype(value: str) -> str:
    """vLLM's --dtype values; half and float are float16 and float32."""
    if value not in DTYPE_CHOICES:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {', '.join(DTYPE_CHOICES)})")
    return _DTYPE_ALIASES.get(value, value)


_ALIASES = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",),
            "pipeline_parallel_size": ("-pp",),
            "enable_expert_parallel": ("-ep",), "quantization": ("-q",)}
_FLAG_TYPES = {"max_model_len": parse_max_model_len, "max_num_batched_tokens": human_readable_int,
               "kv_cache_memory_bytes": human_readable_int}


def _flag_options(f) -> dict:
    if f.type in ("bool", "bool | None"):  # --enforce-eager / --no-enforce-eager
        return {"action": argparse.BooleanOptionalAction, "default": f.default}
    if f.name == "served_model_name":  # several names, as vLLM: the first is reported
        return {"nargs": "+", "default": None, "metavar": "NAME"}
    if f.name == "prefix_caching_hash_algo":
        return {"choices": HASH_ALGOS, "default": f.default}
    if f.name == "dtype":
        return {"type": parse_dtype, "default": f.default,
                "metavar": "{" + ",".join(DTYPE_CHOICES) + "}"}
    kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
    return {"type": _FLAG_TYPES.get(f.name, kind), "default": f.default}


# -- vLLM flags beyond jaxllm's -----------------------------------------------------------------
# Each entry is one flag with its aliases, "|"-separated, named as in vLLM's `vllm serve --help`
# (vllm/engine/arg_utils.py). A flag missing from every table is a typo: argparse's error.

# Accepted and ignored: (flag, takes a value). jaxllm has no such behaviour to switch.
ENGINE_FLAGS_NO_EFFECT = (
    ("--trust-remote-code", False),  # jaxllm runs its own model code, never the checkpoint's
    ("--no-trust-remote-code", False),
    ("--disable-log-stats", False),
    ("--enable-chunked-prefill", False),  # jaxllm always chunks long prefills
    ("--use-tqdm-on-load", False),
    ("--no-use-tqdm-on-load", False),
    ("--disable-custom-all-reduce", False),  # XLA owns the collectives
    ("--swap-space", True),  # a V0 preemption buffer; jaxllm preempts by recompute
    ("--max-parallel-loading-workers", True),
    ("--show-hidden-metrics-for-version", True),  # the deprecated metric names are always shown
)

# Accepted at the value that is jaxllm's behaviour, refused at any other: (flag, value).
ENGINE_FLAGS_DEFAULT_ONLY = (
    ("--tokenizer-mode", "auto"),
    ("--model-impl", "auto"),
    ("--scheduling-policy", "fcfs"),
    ("--stream-interval", "1"),
    # jaxllm reads only the EOS ids from generation_config.json, never its sampling defaults:
    # vLLM's `vllm` mode; `auto` (vLLM's default) would change outputs.
    ("--generation-config", "vllm"),
)

ENGINE_FLAGS_NOT_IMPLEMENTED = (
    "--hf-config-path", "--allowed-local-media-path",
    "--allowed-media-domains", "--revision", "--code-revision", "--tokenizer-revision",
    "--allow-deprecated-quantization", "--enable-return-routed-experts",
    "--max-logprobs", "--logprobs-mode", "--disable-sliding-window", "--disable-cascade-attn",
    "--skip-tokenizer-init", "--enable-prompt-embeds", "--config-format", "--hf-token",
    "--hf-overrides", "--logits-processor-pattern",
    "--override-generation-config", "--enable-sleep-mode", "--override-attention-dtype",
    "--logits-processors", "--io-processor-plugin", "--task", "--max-seq-len-to-capture",
    "--download-dir", "--safetensors-load-strategy", "--model-loader-extra-config",
    "--ignore-patterns", "--pt-load-map-location", "--reasoning-parser",
    "--reasoning-parser-plugin", "--guided-decoding-backend", "--distributed-executor-backend",
    "--master-addr", "--master-port", "--nnodes|-n", "--node-rank|-r",
    "--decode-context-parallel-size|-dcp", "--dcp-kv-cache-interleave-size",
    "--cp-kv-cache-interleave-size", "--prefill-context-parallel-size|-pcp",
    "--data-parallel-rank|-dpn", "--data-parallel-start-rank|-dpr",
    "--data-parallel-size-local|-dpl", "--data-parallel-address|-dpa",
    "--data-parallel-rpc-port|-dpp", "--data-parallel-backend|-dpb",
    "--data-parallel-hybrid-lb|-dph", "--data-parallel-external-lb|-dpe", "--all2all-backend",
    "--enable-dbo", "--ubatch-size", "--dbo-decode-token-threshold",
    "--dbo-prefill-token-threshold", "--disable-nccl-for-dp-synchronization", "--enable-eplb",
    "--eplb-config", "--expert-placement-strategy", "--ray-workers-use-nsight", "--worker-cls",
    "--worker-extension-cls", "--cpu-offload-gb", "--calculate-kv-scales",
    "--kv-sharing-fast-prefill", "--mamba-cache-dtype", "--mamba-ssm-cache-dtype",
    "--mamba-block-size", "--mamba-cache-mode", "--kv-offloading-size", "--kv-offloading-backend",
    "--limit-mm-per-prompt", "--enable-mm-embeds", "--media-io-kwargs", "--mm-processor-kwargs",
    "--mm-processor-cache-gb", "--mm-processor-cache-type", "--mm-shm-cache-max-object-size-mb",
    "--mm-encoder-only", "--mm-encoder-tp-mode", "--mm-encoder-attn-backend",
    "--interleave-mm-strings", "--skip-mm-profiling", "--video-pruning-rate", "--lora-dtype",
    "--enable-tower-connector-lora", "--fully-sharded-loras", "--default-mm-loras", "--specialize-active-lora",
    "--otlp-traces-endpoint", "--collect-detailed-traces", "--kv-cache-metrics",
    "--kv-cache-metrics-sample", "--cudagraph-metrics", "--enable-layerwise-nvtx-tracing",
    "--enable-mfu-metrics", "--enable-logging-iteration-details", "--max-num-partial-prefills",
    "--max-long-partial-prefills", "--long-prefill-token-threshold",
    "--no-enable-chunked-prefill", "--disable-chunked-mm-input", "--scheduler-cls",
    "--disable-hybrid-kv-cache-manager", "--cudagraph-capture-sizes",
    "--max-cudagraph-capture-size", "--kv-transfer-config",
    "--kv-events-config", "--ec-transfer-config", "--compilation-config|-cc",
    "--attention-config|-ac", "--additional-config", "--structured-outputs-config",
    "--profiler-config", "--optimization-level", "--weight-transfer-config",
    "--enable-fault-tolerance", "--aggregate-engine-logging",
)


class _NoEffect(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        pass


class _DefaultOnly(argparse.Action):
    def __init__(self, option_strings, dest, only: str, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.only = only

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values.strip() != self.only:
            flag = self.option_strings[0]
            refuse(parser, f"{flag} {values}", f"{flag} {self.only}")


class _NotImplemented(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        refuse(parser, self.option_strings[0])


def refuse(parser: argparse.ArgumentParser, flag: str, what_works: str | None = None) -> None:
    """One line naming the vLLM flag, instead of argparse's usage and 'unrecognized arguments'."""
    hint = f", only {what_works}" if what_works else ""
    parser.exit(2, f"{parser.prog}: error: jaxllm does not support {flag} yet{hint} "
                   f"(`{parser.prog} --help` lists what it implements)\n")


def add_vllm_compat_flags(parser: argparse.ArgumentParser, no_effect, default_only,
                          not_implemented) -> None:
    """Registers vLLM flags beyond jaxllm's (see ENGINE_FLAGS_NO_EFFECT and the tables below it)."""
    accepted = parser.add_argument_group("vLLM flags accepted for compatibility (no effect)")
    for names, takes_value in no_effect:
        accepted.add_argument(*names.split("|"), action=_NoEffect, nargs=1 if takes_value else 0,
                              default=argparse.SUPPRESS)
    for names, only in default_only:
        accepted.add_argument(*names.split("|"), action=_DefaultOnly, only=only,
                              default=argparse.SUPPRESS, help=f"only {only}")
    for names in not_implemented:
        parser.add_argument(*names.split("|"), action=_NotImplemented, nargs="?",
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def parse_cli_args(parser: argparse.ArgumentParser,
                   argv: list[str] | None = None) -> argparse.Namespace:
    """parse_args, where a flag no table knows (a typo) gets argparse's error with the closest
    flag of the (sub)command it was given to."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = _innermost_parser(parser, args)
        known = [name for action in command._actions for name in action.option_strings]
        hints = []
        for arg in unknown:
            close = difflib.get_close_matches(arg.split("=")[0], known, n=1)
            hints.append(f"{arg} (did you mean {close[0]}?)" if arg.startswith("-") and close
                         else arg)
        command.error(f"unrecognized arguments: {' '.join(hints)}")
    return args


def _innermost_parser(parser: argparse.ArgumentParser, args: argparse.Namespace):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None))
            if chosen is not None:
                return _innermost_parser(chosen, args)
    return parser
