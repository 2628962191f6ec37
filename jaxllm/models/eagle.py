"""EAGLE draft heads (Li et al., 2024): a single decoder layer that drafts tokens from the target
model's features instead of from tokens alone.

EAGLE (v1), the layout of the public checkpoints for Llama (e.g. EAGLE-LLaMA3-Instruct-8B):
at position j the head reads the pair (token t_{j+1}, the target's final-normed hidden state
f_j), x_j = fc([embed(t_{j+1}); f_j]) (fc: [2H] -> [H], bias optional), runs one Llama decoder
layer whose input norm is left out, and returns g_j, its prediction of f_{j+1}: the target's LM
head on g_j gives the draft for t_{j+2}. Drafting on, the head feeds g_j back as the feature of
the next position. The head shares the target's embedding and LM head (as vLLM does).

EAGLE-3 (Li et al., 2025): the feature is fc applied to the target's residual stream entering
three layers, [low; middle; high] ([3H] -> [H]); the layer's attention reads
[input_norm(embed(t)); hidden_norm(feature)] ([2H]); a final norm and the head's own LM head over
a smaller draft vocabulary, mapped back to the target's ids by d2t (target = draft + d2t[draft]);
the feature fed back while drafting is the layer's output before that final norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm.models.args import ModelArgs
from jaxllm.models.batch import StepBatch
from jaxllm.models.layers import rms_norm
from jaxllm.models.transformer import compute_logits, layer_shapes, run_layers


@dataclass(frozen=True)
class EagleArgs:
    """The head's static shape: its decoder layer's args (num_layers 1) and its variant."""
    layer: ModelArgs
    eagle3: bool = False
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: target layers whose input streams are features
    draft_vocab_size: int = 0  # EAGLE-3: the head's own LM head's vocabulary


def eagle3_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers EAGLE-3 reads (the training recipe's, as vLLM's)."""
    return 2, num_target_layers // 2, num_target_layers - 3


def param_shapes(eagle: EagleArgs) -> dict:
    """The head's params with a shape tuple at every leaf (storage layout, [in, out]); an fc
    bias, when the checkpoint has one, is params["fc_bias"] [H] beside them."""
    args, h = eagle.layer, eagle.layer.hidden_size
    layer = layer_shapes(args)
    shapes = {"fc": ((len(eagle.aux_layers) if eagle.eagle3 else 2) * h, h), "layers": [layer]}
    if eagle.eagle3:
        layer.update(wq=(2 * h, args.q_size), wk=(2 * h, args.kv_size), wv=(2 * h, args.kv_size),
                     hidden_norm=(h,))
        shapes.update(final_norm=(h,), lm_head=(h, eagle.draft_vocab_size),
                      d2t=(eagle.draft_vocab_size,))
    else:
        del layer["attn_norm"]  # EAGLE (v1) leaves the input norm out
    return shapes


def input_features(eagle: EagleArgs, params: dict, features: jax.Array) -> jax.Array:
    """The target's features [T, F] -> the head's [T, H]: EAGLE-3's fc over the three streams;
    EAGLE (v1) reads the final hidden state as it is."""
    if not eagle.eagle3:
        return features
    return _linear(features, params["fc"], params.get("fc_bias"))


def draft_hidden(eagle: EagleArgs, params: dict, embed: jax.Array, kv_cache, batch: StepBatch,
                 features: jax.Array, *, attn, write_kv):
    """The head over a ragged batch: batch.token_ids [T] are the tokens t_{j+1} paired with
    features [T, H] (the head's, after input_features) at batch.positions j. -> (hidden [T, H]:
    what the head feeds back and reads logits from, kv_cache). The head's KV cache (one
    layer) lives under the target's block tables."""
    args, layer = eagle.layer, params["layers"][0]
    embeds = embed[batch.token_ids]
    features = features.astype(embeds.dtype)
    if eagle.eagle3:
        x = jnp.concatenate([rms_norm(embeds, layer["attn_norm"], args.rms_norm_eps),
                             rms_norm(features, layer["hidden_norm"], args.rms_norm_eps)], -1)
        residual = features
    else:
        x = _linear(jnp.concatenate([embeds, features], -1), params["fc"], params.get("fc_bias"))
        residual = None
    # The input norms are applied above: the layer proper starts at its attention.
    core = {name: value for name, value in layer.items() if name not in ("attn_norm",
                                                                         "hidden_norm")}
    out, caches = run_layers([core], [kv_cache], x, batch, args=args, attn=attn,
                             write_kv=write_kv, residual=residual)
    return out, caches[0]


def draft_logits(eagle: EagleArgs, params: dict, target_params: dict,
                 hidden: jax.Array) -> jax.Array:
    """hidden [N, H] -> logits [N, V] float32 over the target's vocabulary: EAGLE (v1) applies
    the target's LM head to the hidden state as it is; EAGLE-3 its own norm and head."""
    if not eagle.eagle3:
        return compute_logits(target_params, hidden)
    normed = rms_norm(hidden, params["final_norm"], eagle.layer.rms_norm_eps)
    return jnp.einsum("nh,hv->nv", normed, params["lm_head"], preferred_element_type=jnp.float32)


def draft_token_ids(eagle: EagleArgs, params: dict, target_params: dict,
                    hidden: jax.Array) -> jax.Array:
    """The greedy draft token [N] (target ids) after each hidden state [N, H]."""
    ids = jnp.argmax(draft_logits(eagle, params, target_params, hidden), axis=-1)
    if eagle.eagle3:
        ids = ids + params["d2t"][ids]
    return ids.astype(jnp.int32)


def _linear(x: jax.Array, w: jax.Array, bias: jax.Array | None) -> jax.Array:
    out = jnp.einsum("tc,ch->th", x.astype(w.dtype), w)
    return out if bias is None else out + bias
