"""EAGLE / EAGLE-3 draft heads from an HF-format directory (config.json and the weights, as the
public checkpoints ship them: safetensors, or pytorch_model.bin where torch is installed).

Tensor names (a leading "model." is ignored): fc.weight / fc.bias; EAGLE's decoder layer as
layers.0.<Llama layer suffix>, EAGLE-3's as midlayer.<suffix> with midlayer.hidden_norm.weight;
EAGLE-3's norm.weight, lm_head.weight and d2t. The head's embed_tokens and EAGLE-3's t2d are
skipped: the target's embedding is shared, and t2d only says which target ids d2t reaches.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from jaxllm.loader.hf_names import flatten_paths, map_hf_name, unflatten_paths
from jaxllm.loader.placement import place
from jaxllm.loader.safetensors_io import iter_tensors, safetensors_files
from jaxllm.models import ModelArgs, fuse_params
from jaxllm.models.eagle import EagleArgs, eagle3_aux_layers, param_shapes

_SKIPPED = ("embed_tokens.weight", "t2d")


def read_eagle_args(model_dir: str, method: str, target: ModelArgs) -> EagleArgs:
    """The head's EagleArgs from its config.json, checked against the target's shapes."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"EAGLE head {model_dir!r} has no config.json.")
    with open(path) as f:
        cfg = json.load(f)
    # The head's layer is a Llama layer whatever its architectures entry names.
    layer = ModelArgs.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"],
                                      "num_hidden_layers": 1})
    if layer.hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE head {model_dir!r} has hidden_size {layer.hidden_size}; the "
                         f"target model's is {target.hidden_size}.")
    if cfg.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"EAGLE head {model_dir!r} has vocab_size {cfg['vocab_size']}; the "
                         f"target model's is {target.vocab_size}.")
    eagle3 = method == "eagle3"
    # vLLM's key for heads trained on other layers than the recipe's default three
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(aux) if aux else eagle3_aux_layers(target.num_layers)
    if eagle3 and not all(0 <= i < target.num_layers for i in aux):
        raise ValueError(f"EAGLE-3 head {model_dir!r} reads target layers {list(aux)}; the "
                         f"target model has {target.num_layers}.")
    return EagleArgs(layer=layer, eagle3=eagle3, aux_layers=aux if eagle3 else (),
                     draft_vocab_size=int(cfg.get("draft_vocab_size") or target.vocab_size)
                     if eagle3 else 0)


def load_eagle_head(model_dir: str, eagle: EagleArgs, dtype) -> dict:
    """The head's params in the compute layout (fused QKV and gate/up), on the default device."""
    expected = flatten_paths(param_shapes(eagle))
    expected["fc_bias"] = (eagle.layer.hidden_size,)  # optional: EAGLE (v1) checkpoints have it
    flat = {}
    for name, host in _tensors(model_dir):
        mapped = _map_name(name)
        if mapped is None or mapped[0] not in expected:
            continue  # the shared embedding, t2d, an EAGLE (v1) layer's unused input norm
        path, transpose = mapped
        shape = tuple(reversed(host.shape)) if transpose else tuple(host.shape)
        if shape != expected[path]:
            raise ValueError(f"EAGLE head weight {name} has shape {host.shape}; the head's "
                             f"config expects {expected[path]} for {path}.")
        flat[path] = (jnp.asarray(np.asarray(host, np.int32)) if path == "d2t"
                      else place(host, dtype, transpose))
    missing = sorted(set(expected) - set(flat) - {"fc_bias"})
    if missing:
        raise ValueError(f"EAGLE head {model_dir!r} lacks weights: {missing[:8]}.")
    return fuse_params(unflatten_paths(flat, 1), eagle.layer.num_kv_heads)


def _map_name(name: str) -> tuple[str, bool] | None:
    name = name.removeprefix("model.")
    if name in _SKIPPED:
        return None
    top = {"fc.weight": ("fc", True), "fc.bias": ("fc_bias", False),
           "norm.weight": ("final_norm", False), "lm_head.weight": ("lm_head", True),
           "d2t": ("d2t", False)}
    if name in top:
        return top[name]
    name = name.replace("midlayer.", "layers.0.", 1)
    if name == "layers.0.hidden_norm.weight":
        return "layers.0.hidden_norm", False
    if not name.startswith("layers.0."):
        raise ValueError(f"Unexpected weight {name!r} in the EAGLE head.")
    return map_hf_name("model." + name)


def _tensors(model_dir: str):
    """(name, numpy array) of every tensor of the head's weights."""
    if any(n.endswith(".safetensors") for n in os.listdir(model_dir)):
        for path in safetensors_files(model_dir):
            yield from iter_tensors(path)
        return
    path = os.path.join(model_dir, "pytorch_model.bin")
    if not os.path.isfile(path):
        raise ValueError(f"EAGLE head {model_dir!r} has no *.safetensors or pytorch_model.bin.")
    try:
        import torch
    except ImportError:
        raise ValueError(f"EAGLE head {model_dir!r} ships pytorch_model.bin, which needs torch "
                         "to read; install torch or convert it to safetensors.") from None
    for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
        yield name, (tensor.float() if tensor.is_floating_point() else tensor).numpy()
