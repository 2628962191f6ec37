"""The decoder as a pure function over a params pytree and a paged KV cache.

One step runs every scheduled token of every sequence (a ragged `StepBatch`); layers are a Python
loop over per-layer arrays, so the step unrolls them (measured much faster than a scan).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.models.args import ModelArgs
from jaxllm.models import moe  # noqa: F401  (registers the "moe" and "moe_ep" MLPs)
from jaxllm.models.layer_stacks import layer_views, value
from jaxllm.models.layers import MLPS, apply_rope, rms_norm, rope_cos_sin
from jaxllm.models.lora import TokenLoRA
from jaxllm.models.quant import (add_residual, linear, materialize, norm_linear,
                                 residual_norm_quant)
from jaxllm.models.batch import StepBatch
from pallas_kernels.kv_write import write_kv_reference
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

KVCache = list[tuple[jax.Array, jax.Array]]  # per layer: [num_blocks, kv_heads, block_size, D]


def layer_shapes(args: ModelArgs, layer_index: int = 0) -> dict[str, tuple[int, ...]]:
    """Per-layer weight shapes as stored (HF's matrices, as [in, out]; forward runs on the fused
    layout `fuse_params` makes of them)."""
    h, q, kv, d = args.hidden_size, args.q_size, args.kv_size, args.head_dim
    shapes = {"attn_norm": (h,), "wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h),
              "mlp_norm": (h,)}
    if args.qkv_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if args.o_bias:
        shapes["bo"] = (h,)
    if args.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    if args.kv_cache_scales:
        shapes.update(k_scale=(), v_scale=())
    shapes.update(MLPS[args.layer_mlp_kind(layer_index)][1](args))
    return shapes


def param_shapes(args: ModelArgs) -> dict:
    """The params pytree with a shape tuple at every leaf."""
    shapes = {"embed": (args.vocab_size, args.hidden_size),
              "layers": [layer_shapes(args, i) for i in range(args.num_layers)],
              "final_norm": (args.hidden_size,)}
    if not args.tie_word_embeddings:
        shapes["lm_head"] = (args.hidden_size, args.vocab_size)
    return shapes


def _project(x: jax.Array, layer: dict, w: str, b: str, unscaled: bool = False):
    if b in layer:
        return linear(x, layer[w]) + value(layer[b])
    return linear(x, layer[w], unscaled)


def _qkv(layer: dict, x: jax.Array, args: ModelArgs, lora: TokenLoRA | None = None,
         quantized=None, unscaled: bool = False):
    """x [T, H] (the residual stream) -> qkv [T, Hkv, G + 2, D] (each KV head's G query heads,
    then its k and v): the input norm and one GEMM over the fused wqkv (models/fused.py), the
    norm in the GEMM where it fits (or x's norm already quantised:
    quant.residual_norm_quant's). A layer without an input norm (EAGLE's draft layer) reads x
    as it is. unscaled: an FP8 qkv may come unfinished, a W8A8 GEMM's quant.ScaledProduct or
    a K-split GEMV's quant.SplitProduct (quant.norm_linear)."""
    if lora is None and "attn_norm" in layer:
        qkv = norm_linear(x, layer["attn_norm"], args.rms_norm_eps, layer["wqkv"], quantized,
                          unscaled=unscaled and "bqkv" not in layer)
    else:
        h = rms_norm(x, layer["attn_norm"], args.rms_norm_eps) if "attn_norm" in layer else x
        qkv = linear(h, layer["wqkv"])  # [T, Hkv, G + 2, D]
        if lora is not None:
            qkv = lora.add(qkv, h, "qkv")
    if "bqkv" in layer:
        qkv = qkv + value(layer["bqkv"])
    return qkv


def _split_qkv(qkv: jax.Array, args: ModelArgs):
    """qkv [T, Hkv, G + 2, D] -> q [T, Hq, D] (query head i grouped with KV head i // G), k,
    v [T, Hkv, D]."""
    group = args.num_heads // args.num_kv_heads
    q = qkv[:, :, :group].reshape(qkv.shape[0], args.num_heads, args.head_dim)
    return q, qkv[:, :, group], qkv[:, :, group + 1]


def _attention_block(layer: dict, x: jax.Array, k_cache, v_cache, batch: StepBatch, cos, sin,
                     args: ModelArgs, attn: Callable, write_kv: Callable,
                     lora: TokenLoRA | None, quantized=None):
    """-> (the o projection's output: an array, or without LoRA an FP8 one's
    quant.ScaledProduct, the caches)."""
    num_tokens = x.shape[0]
    # A checkpoint's static KV scales, applied around the kernels (which then keep 1.0): the
    # float8 pages hold k / k_scale and v / v_scale, q @ k = (q * k_scale) @ pages' k, and
    # p @ v = (p @ pages' v) * v_scale.
    scaled = "k_scale" in layer and k_cache.dtype == jnp.float8_e4m3fn
    # the KV write's own rope where the layer's is plain (models/attention.py), an FP8 qkv
    # finished inside it too
    rope_write = None if args.qk_norm or scaled else getattr(write_kv, "rope_write", None)
    qkv = _qkv(layer, x, args, lora, quantized, unscaled=rope_write is not None)
    if rope_write is not None:
        q, k_cache, v_cache = rope_write(k_cache, v_cache, qkv, cos, sin, batch.slot_mapping)
    else:
        q, k, v = _split_qkv(qkv, args)
        if args.qk_norm:
            q = rms_norm(q, layer["q_norm"], args.rms_norm_eps)
            k = rms_norm(k, layer["k_norm"], args.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if scaled:
            k_scale, v_scale = value(layer["k_scale"]), value(layer["v_scale"])
            q, k, v = q * k_scale, k / k_scale, v / v_scale
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
    out = attn(q, k_cache, v_cache, batch.kv_lens, batch.block_tables, batch.cu_q_lens,
               batch.num_seqs, sm_scale=args.head_dim ** -0.5, sliding_window=args.sliding_window)
    if scaled:
        out = out * v_scale
    out = out.reshape(num_tokens, args.q_size)
    if lora is not None:
        return lora.add(_project(out, layer, "wo", "bo"), out, "o"), k_cache, v_cache
    return _project(out, layer, "wo", "bo", unscaled=True), k_cache, v_cache


def forward(params: dict, kv_caches: KVCache, batch: StepBatch, *, args: ModelArgs,
            attn: Callable = ragged_paged_attention_reference,
            write_kv: Callable = write_kv_reference, return_hidden: bool = False,
            aux_layers: tuple[int, ...] = ()):
    """-> (logits [S, V] float32 at batch.logits_indices, updated kv_caches), and with
    return_hidden also the final-normed hidden states of every token [T, H] (prompt logprobs)
    and, given aux_layers, the residual streams entering those layers side by side
    [T, len(aux_layers) * H] (EAGLE-3's features). params in the compute layout (`fuse_params`).

    Compute runs in the params' dtype; norms, rope and softmax accumulate in fp32. With LoRA,
    params["lora"] holds every layer's adapter stacks (models/lora.py) and batch.lora_slots
    each token's slot; params["layer_stacks"], when there, the layers' stacked entries
    (models/layer_stacks.py).
    """
    x = embed_tokens(params, batch)
    aux = []
    x, new_caches = run_layers(layer_views(params), kv_caches, x, batch, args=args, attn=attn,
                               write_kv=write_kv, loras=params.get("lora"),
                               capture=dict.fromkeys(aux_layers, aux))
    outputs = final_outputs(params, x, batch, new_caches, args=args, return_hidden=return_hidden)
    return (*outputs, jnp.concatenate(aux, -1)) if aux_layers and return_hidden else outputs


def embed_tokens(params: dict, batch: StepBatch) -> jax.Array:
    """The step's token embeddings [T, H]."""
    return params["embed"][batch.token_ids]


def run_layers(layers: list[dict], kv_caches: KVCache, x: jax.Array, batch: StepBatch, *,
               args: ModelArgs, attn: Callable = ragged_paged_attention_reference,
               write_kv: Callable = write_kv_reference,
               loras: list[dict] | None = None,
               residual: jax.Array | None = None,
               capture: dict[int, list] | None = None) -> tuple[jax.Array, KVCache]:
    """A contiguous range of decoder layers (all of them, or one pipeline stage's) with their
    KV caches, over the residual stream x [T, H] -> (x, updated kv_caches). loras: the layers'
    LoRA adapter stacks (models/lora.py), read at batch.lora_slots. residual: the stream the
    first layer's attention output adds to, when that layer reads another input x (EAGLE-3's
    draft layer attends over [embedding; feature], [T, 2H]). capture: layer index -> a list
    the stream entering that layer is appended to.
    Between layers the stream may be a quant.ResidualSum: an FP8 projection's output not yet
    added, which the next input norm's kernel adds (quant.residual_norm_quant)."""
    mlp = MLPS[args.mlp_kind][0]
    cos, sin = rope_cos_sin(batch.positions, args)
    new_caches = []
    loras = loras or [None] * len(layers)
    # the dense MLP takes adapters and its input norm; experts take no adapters (models/lora.py)
    dense = args.mlp_kind == "dense"
    for index, (layer, (k_cache, v_cache), stacks) in enumerate(zip(layers, kv_caches, loras,
                                                                    strict=True)):
        if capture and index in capture:
            x = materialize(x)
            capture[index].append(x)
        lora = None if stacks is None else TokenLoRA(stacks, batch.lora_slots)
        quantized = None
        if lora is None and "attn_norm" in layer:
            x, quantized = residual_norm_quant(x, layer["attn_norm"], args.rms_norm_eps,
                                               layer["wqkv"])
        x = materialize(x)
        out, k_cache, v_cache = _attention_block(layer, x, k_cache, v_cache, batch, cos, sin,
                                                 args, attn, write_kv, lora, quantized)
        x = add_residual(x if residual is None else residual, out)
        residual = None
        if dense and lora is None:  # the norm fused into the gate/up GEMV where it can be
            x, quantized = residual_norm_quant(x, layer["mlp_norm"], args.rms_norm_eps,
                                               layer["w_gate_up"])
            x = add_residual(x, mlp(layer, x, args, norm_weight=layer["mlp_norm"],
                                    quantized=quantized, unscaled=True))
        else:
            x = materialize(x)
            x = x + (mlp(layer, x, args, lora=lora, norm_weight=layer["mlp_norm"]) if dense
                     else mlp(layer, rms_norm(x, layer["mlp_norm"], args.rms_norm_eps), args))
        new_caches.append((k_cache, v_cache))
    return materialize(x), new_caches


def final_outputs(params: dict, x: jax.Array, batch: StepBatch, kv_caches: KVCache, *,
                  args: ModelArgs, return_hidden: bool = False):
    """The final norm and the logits at batch.logits_indices after the last layer: forward's
    outputs, kv_caches passed through."""
    if return_hidden:
        hidden = rms_norm(x, params["final_norm"], args.rms_norm_eps)  # [T, H]
        return compute_logits(params, hidden[batch.logits_indices]), kv_caches, hidden
    x = rms_norm(x[batch.logits_indices], params["final_norm"], args.rms_norm_eps)  # [S, H]
    return compute_logits(params, x), kv_caches


def compute_logits(params: dict, x: jax.Array) -> jax.Array:
    """x [N, H] final-normed -> logits [N, V] float32 (the LM head, or the tied embedding)."""
    if "lm_head" in params:
        return jnp.einsum("nh,hv->nv", x, params["lm_head"], preferred_element_type=jnp.float32)
    return jnp.einsum("nh,vh->nv", x, params["embed"], preferred_element_type=jnp.float32)
