"""BERT-family encoders (BERT, RoBERTa, XLM-R) as a pure function over a padded batch.

Absolute learned positions, token types, post-LayerNorm blocks, GELU MLP, bidirectional
attention within each row (models/padded_attention.py). Params pytree (HF's matrices as
[in, out]; q, k and v stay three matrices: three GEMMs write the three arrays cuDNN's attention
reads, where slicing them out of one fused output cost a copy of each):
  word_embed [V, H], position_embed [P, H], type_embed [types, H], embed_norm_w/_b [H],
  layers: [{wq, bq, wk, bk, wv, bv, wo, bo, attn_norm_w/_b, w_in, b_in, w_out, b_out,
            mlp_norm_w/_b}]
and the classifier head of a *ForSequenceClassification model (models/pooler.py):
  head_dense_w [H, H], head_dense_b [H] (BERT's pooler, RoBERTa's classifier.dense),
  classifier_w [H, labels], classifier_b [labels].
With LoRA, params["lora"] holds every layer's adapter slots (models/lora.py) and each row names
its slot: the updates add onto q/k/v (one group, in HF's column order), the attention output and
both MLP projections.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.models.lora import TokenLoRA
from jaxllm.models.padded_attention import padded_attention
from pallas_kernels import layer_norm as layer_norm_kernels

# architecture -> position offset (RoBERTa numbers positions from pad_token_id + 1)
ENCODER_ARCHITECTURES = {
    "BertModel": "bert", "BertForSequenceClassification": "bert",
    "RobertaModel": "roberta", "RobertaForSequenceClassification": "roberta",
    "XLMRobertaModel": "roberta", "XLMRobertaForSequenceClassification": "roberta",
}
_SQRT_HALF = 0.7071067811865476
_GELUS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}  # -> tanh approximation


@dataclass(frozen=True)
class BertArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int = 0
    gelu_approximate: bool = False
    num_labels: int = 0  # 0: no classifier head

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_len(self) -> int:
        """The longest sequence the position table covers."""
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf_config(cls, cfg: dict, with_classifier: bool) -> "BertArgs":
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in ENCODER_ARCHITECTURES:
            raise ValueError(f"Model architecture {arch!r} is not an encoder jaxllm supports: "
                             f"{sorted(ENCODER_ARCHITECTURES)}.")
        act = cfg.get("hidden_act", "gelu")
        if act not in _GELUS:
            raise ValueError(f"hidden_act {act!r} is not supported; supported: {sorted(_GELUS)}.")
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("Only absolute position embeddings are supported, got "
                             f"{cfg['position_embedding_type']!r}.")
        roberta = ENCODER_ARCHITECTURES[arch] == "roberta"
        num_labels = len(cfg.get("id2label") or {}) or cfg.get("num_labels", 2)
        return cls(architecture=arch, vocab_size=cfg["vocab_size"],
                   hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                   num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                   max_position_embeddings=cfg["max_position_embeddings"],
                   type_vocab_size=cfg.get("type_vocab_size", 2),
                   layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
                   position_offset=cfg.get("pad_token_id", 1) + 1 if roberta else 0,
                   gelu_approximate=_GELUS[act],
                   num_labels=num_labels if with_classifier else 0)


def param_shapes(args: BertArgs) -> dict:
    h, i = args.hidden_size, args.intermediate_size
    layer = {"wq": (h, h), "bq": (h,), "wk": (h, h), "bk": (h,), "wv": (h, h), "bv": (h,),
             "wo": (h, h), "bo": (h,), "attn_norm_w": (h,), "attn_norm_b": (h,),
             "w_in": (h, i), "b_in": (i,), "w_out": (i, h), "b_out": (h,),
             "mlp_norm_w": (h,), "mlp_norm_b": (h,)}
    shapes = {"word_embed": (args.vocab_size, h),
              "position_embed": (args.max_position_embeddings, h),
              "type_embed": (args.type_vocab_size, h), "embed_norm_w": (h,), "embed_norm_b": (h,),
              "layers": [dict(layer) for _ in range(args.num_layers)]}
    if args.num_labels:
        shapes.update(head_dense_w=(h, h), head_dense_b=(h,),
                      classifier_w=(h, args.num_labels), classifier_b=(args.num_labels,))
    return shapes


layer_norm = layer_norm_kernels.layer_norm_reference  # over the last axis, in fp32


def add_layer_norm(x: jax.Array, residual: jax.Array, weight: jax.Array, bias: jax.Array,
                   eps: float) -> jax.Array:
    """layer_norm(x + residual) (the sum in fp32): one Pallas kernel on a GPU, where XLA's two
    passes ran ~20% slower (docs/lab); its reference elsewhere."""
    if jax.default_backend() == "gpu":
        return layer_norm_kernels.add_layer_norm(x, residual, weight, bias, eps)
    return layer_norm_kernels.add_layer_norm_reference(x, residual, weight, bias, eps)


def gelu(x: jax.Array, approximate: bool) -> jax.Array:
    """GELU in x's dtype; the exact (erf) form computed in fp32 by hand: XLA's fusion of
    jax.nn.gelu on 16-bit inputs takes twice as long on an H200 (docs/lab)."""
    if approximate:
        return jax.nn.gelu(x, approximate=True)
    x32 = x.astype(jnp.float32)
    return (x32 * 0.5 * (1 + jax.lax.erf(x32 * _SQRT_HALF))).astype(x.dtype)


def _layer(layer: dict, x: jax.Array, lengths: jax.Array, args: BertArgs,
           implementation: str | None, lora: TokenLoRA | None) -> jax.Array:
    num_seqs, max_len, _ = x.shape

    def adapted(base, inputs, group):  # base [S, L, ...] + the rows' adapters' update
        if lora is None:
            return base
        flat = lambda a: a.reshape(num_seqs * max_len, *a.shape[2:])  # noqa: E731
        return lora.add(flat(base), flat(inputs), group).reshape(base.shape)

    q, k, v = ((x @ layer[f"w{name}"] + layer[f"b{name}"]).reshape(
        num_seqs, max_len, args.num_heads, args.head_dim) for name in "qkv")  # [S, L, heads, D]
    if lora is not None:  # the group's columns: all of q, then k, then v
        q, k, v = jnp.unstack(adapted(jnp.stack([q, k, v], axis=2), x, "qkv"), axis=2)
    attn = padded_attention(q, k, v, lengths, causal=False, sm_scale=args.head_dim ** -0.5,
                            implementation=implementation).reshape(num_seqs, max_len, -1)
    attn = adapted(jnp.einsum("slo,oh->slh", attn, layer["wo"]) + layer["bo"], attn, "o")
    x = add_layer_norm(attn, x, layer["attn_norm_w"], layer["attn_norm_b"], args.layer_norm_eps)
    h = adapted(jnp.einsum("slh,hi->sli", x, layer["w_in"]) + layer["b_in"], x, "in")
    h = gelu(h, args.gelu_approximate)
    h = adapted(jnp.einsum("sli,ih->slh", h, layer["w_out"]) + layer["b_out"], h, "out")
    return add_layer_norm(h, x, layer["mlp_norm_w"], layer["mlp_norm_b"], args.layer_norm_eps)


def encode(params: dict, token_ids: jax.Array, token_type_ids: jax.Array, lengths: jax.Array, *,
           args: BertArgs, implementation: str | None = None,
           lora_slots: jax.Array | None = None) -> jax.Array:
    """token_ids, token_type_ids [S, L] (rows padded past lengths[s] >= 1) -> the last layer's
    hidden states [S, L, H] in the params' dtype (LayerNorms in fp32). lora_slots [S]: each
    row's adapter slot in params["lora"] (0: none)."""
    positions = jnp.arange(token_ids.shape[1]) + args.position_offset
    x = (params["word_embed"][token_ids] + params["position_embed"][positions][None]
         + params["type_embed"][token_type_ids])
    x = layer_norm(x, params["embed_norm_w"], params["embed_norm_b"], args.layer_norm_eps)
    token_slots = (None if lora_slots is None
                   else jnp.repeat(lora_slots.astype(jnp.int32), token_ids.shape[1]))
    for i, layer in enumerate(params["layers"]):
        lora = None if token_slots is None else TokenLoRA(params["lora"][i], token_slots)
        x = _layer(layer, x, lengths, args, implementation, lora)
    return x
