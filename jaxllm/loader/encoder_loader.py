"""BERT-family checkpoints (HF safetensors) -> the params pytree of jaxllm/models/bert.py.

Names are HF's BertModel / RobertaModel ones, with the "bert." / "roberta." prefix of a
*ForSequenceClassification checkpoint stripped; linear weights are [out, in] there and
[in, out] here.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from jaxllm.loader.hf_names import flatten_paths, unflatten_paths
from jaxllm.loader.placement import place
from jaxllm.loader.safetensors_io import iter_tensors, safetensors_files
from jaxllm.models.bert import BertArgs, param_shapes

_TOP = {
    "embeddings.word_embeddings.weight": ("word_embed", False),
    "embeddings.position_embeddings.weight": ("position_embed", False),
    "embeddings.token_type_embeddings.weight": ("type_embed", False),
    "embeddings.LayerNorm.weight": ("embed_norm_w", False),
    "embeddings.LayerNorm.bias": ("embed_norm_b", False),
    # the classifier head: BERT's pooler and classifier, RoBERTa's classifier.dense / out_proj
    "pooler.dense.weight": ("head_dense_w", True),
    "pooler.dense.bias": ("head_dense_b", False),
    "classifier.weight": ("classifier_w", True),
    "classifier.bias": ("classifier_b", False),
    "classifier.dense.weight": ("head_dense_w", True),
    "classifier.dense.bias": ("head_dense_b", False),
    "classifier.out_proj.weight": ("classifier_w", True),
    "classifier.out_proj.bias": ("classifier_b", False),
}
_LAYER = {
    "attention.self.query": ("wq", "bq"), "attention.self.key": ("wk", "bk"),
    "attention.self.value": ("wv", "bv"), "attention.output.dense": ("wo", "bo"),
    "attention.output.LayerNorm": ("attn_norm_w", "attn_norm_b"),
    "intermediate.dense": ("w_in", "b_in"), "output.dense": ("w_out", "b_out"),
    "output.LayerNorm": ("mlp_norm_w", "mlp_norm_b"),
}
_LAYER_RE = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")
_PREFIX_RE = re.compile(r"^(bert|roberta)\.")
_IGNORED = ("embeddings.position_ids", "lm_head.")


def map_encoder_name(name: str) -> tuple[str, bool] | None:
    """-> (param path, transpose), or None for tensors no pooling model uses."""
    name = _PREFIX_RE.sub("", name)
    if name in _TOP:
        return _TOP[name]
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER:
        weight, bias = _LAYER[match.group(2)]
        if match.group(3) == "bias":
            return f"layers.{match.group(1)}.{bias}", False
        return f"layers.{match.group(1)}.{weight}", not weight.endswith("_w")
    if name.startswith(_IGNORED):
        return None
    raise ValueError(f"Unexpected weight {name!r} in the encoder checkpoint.")


def load_encoder(model_dir: str, args: BertArgs, dtype) -> dict:
    """Reads the weights the model uses (a BertModel's pooler is skipped: embeddings pool the
    last hidden states)."""
    expected = flatten_paths(param_shapes(args))
    flat = {}
    for path in safetensors_files(model_dir):
        for name, host in iter_tensors(path):
            mapped = map_encoder_name(name)
            if mapped is None or mapped[0] not in expected:
                continue
            param, transpose = mapped
            shape = tuple(reversed(host.shape)) if transpose else tuple(host.shape)
            if shape != expected[param]:
                raise ValueError(f"Weight {name} has shape {host.shape}; the config expects "
                                 f"{expected[param]} for {param}.")
            flat[param] = place(host, dtype, transpose)
    missing = sorted(set(expected) - set(flat))
    if missing:
        raise ValueError(f"Checkpoint {model_dir} lacks weights: {missing[:8]}.")
    return unflatten_paths(flat, args.num_layers)


def dummy_encoder(args: BertArgs, dtype, seed: int = 0) -> dict:
    """Normal(0, 0.02) matrices, unit LayerNorm weights and zero biases, for benchmarks."""
    rng = np.random.default_rng(seed)
    flat = {}
    for path, shape in flatten_paths(param_shapes(args)).items():
        name = path.rsplit(".", 1)[-1]
        if name.endswith("norm_w"):
            host = np.ones(shape, np.float32)
        elif name.startswith("b") or name.endswith("_b"):
            host = np.zeros(shape, np.float32)
        else:
            host = rng.normal(0.0, 0.02, shape).astype(np.float32)
        flat[path] = jnp.asarray(host, dtype)
    return unflatten_paths(flat, args.num_layers)
