"""Builds the engine of a pooling model (`--runner pooling`): an encoder (BERT, RoBERTa, XLM-R)
or a causal decoder run without a KV cache (with LoRA: its adapter slots), its pooler, the
bucketed runner, warmed up."""

from __future__ import annotations

import logging
from functools import partial

import jax
import jax.numpy as jnp

from jaxllm.config import EngineConfig
from jaxllm.engine.pooling_config import architecture, decoder_base
from jaxllm.engine.pooling_engine import PoolingEngine
from jaxllm.loader.encoder_loader import dummy_encoder, load_encoder
from jaxllm.loader.loader import load_safetensors, load_tokenizer, resolve_dtype
from jaxllm.models import ModelArgs, forward, fuse_params, param_shapes
from jaxllm.models import bert
from jaxllm.models.padded_attention import decoder_hidden
from jaxllm.models.pooler import pooling_forward
from jaxllm.worker.lora_slots import make_lora_slots
from jaxllm.worker.pooling_runner import PoolingRunner, batch_shapes

logger = logging.getLogger("jaxllm")


def build_pooling_engine(config: EngineConfig, log=logger.info) -> PoolingEngine:
    model = config.model_config
    if config.parallel_config.world_size > 1:
        raise ValueError("Pooling models run on one device: tensor_parallel_size, "
                         "data_parallel_size and pipeline_parallel_size must be 1.")
    classify = model.convert == "classify"
    if architecture(model.hf_config) in bert.ENCODER_ARCHITECTURES:
        params, hidden_fn, dims, lora_slots = _encoder(config, classify)
    else:
        params, hidden_fn, dims, lora_slots = _decoder(config, classify)
    pooling_type = config.pooler_config.pooling_type
    sched = config.scheduler_config
    runner = PoolingRunner(
        partial(pooling_forward, hidden_fn=hidden_fn, pooling_type=pooling_type,
                classify=classify), params,
        batch_shapes(model.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens),
        per_token=pooling_type == "ALL", lora_slots=lora_slots)
    tokenizer = (load_tokenizer(model.tokenizer or model.model)
                 if config.load_config.load_format == "auto" or model.tokenizer else None)
    engine = PoolingEngine(config, runner, tokenizer, **dims)
    log(f"pooling model: {architecture(model.hf_config)} as {model.convert}, "
        f"{pooling_type} pooling, {sum(map(len, runner.shapes.values()))} batch shapes")
    if not config.runner_config.enforce_eager:
        runner.warmup(progress=log)
    return engine


def _encoder(config: EngineConfig, classify: bool):
    model = config.model_config
    args = bert.BertArgs.from_hf_config(model.hf_config, with_classifier=classify)
    if model.max_model_len > args.max_len:
        raise ValueError(f"max_model_len ({model.max_model_len}) is greater than the "
                         f"{args.max_len} positions of {args.architecture}.")
    dtype = resolve_dtype(model.dtype)
    params = (dummy_encoder(args, dtype, model.seed) if config.load_config.load_format == "dummy"
              else load_encoder(model.model, args, dtype))
    implementation = _attention_implementation(config, dtype)

    def hidden_fn(params, token_ids, token_type_ids, lengths, lora_slots):
        return bert.encode(params, token_ids, token_type_ids, lengths, args=args,
                           lora_slots=lora_slots, implementation=implementation)
    dims = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size)
    return params, hidden_fn, dims, make_lora_slots(config.lora_config, args, dtype)


def _decoder(config: EngineConfig, classify: bool):
    model = config.model_config
    hf = model.hf_config
    args = ModelArgs.from_hf_config({**hf, "architectures": [decoder_base(architecture(hf))]})
    if args.sliding_window is not None:
        raise ValueError("Sliding-window models are not supported as pooling models.")
    if config.load_config.load_format == "dummy":
        raise ValueError("load_format='dummy' is not supported for decoder pooling models.")
    shapes = {k: v for k, v in param_shapes(args).items() if k != "lm_head"}
    if classify:
        shapes["score"] = (args.hidden_size, len(hf.get("id2label") or {}) or hf.get("num_labels", 2))
    dtype = resolve_dtype(model.dtype)
    params = load_safetensors(model.model, args, dtype, shapes=shapes)
    if classify:
        params["classifier_w"] = params.pop("score")
    params = fuse_params(params, args.num_kv_heads, free_inputs=True)

    implementation = _attention_implementation(config, dtype)

    def hidden_fn(params, token_ids, token_type_ids, lengths, lora_slots):
        return decoder_hidden(params, token_ids, lengths, args=args, forward=forward,
                              lora_slots=lora_slots, implementation=implementation)
    dims = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size)
    return params, hidden_fn, dims, make_lora_slots(config.lora_config, args, dtype)


def _attention_implementation(config: EngineConfig, dtype) -> str | None:
    """jax.nn.dot_product_attention's implementation for the padded rows: cuDNN's fused kernel
    on a GPU in 16 bits (XLA's materialises every row's [L, L] scores in fp32), unless
    --attention-backend xla; XLA elsewhere."""
    if (config.runner_config.attention_backend != "xla" and jax.default_backend() == "gpu"
            and jnp.dtype(dtype) in (jnp.float16, jnp.bfloat16)):
        return "cudnn"
    return None
