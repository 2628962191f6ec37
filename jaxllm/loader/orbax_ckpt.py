"""`jaxllm convert MODEL OUT`: the loaded (converted, dequantised) params saved once as an Orbax
checkpoint, restored straight into the current mesh's shardings (each device reads its shard).

OUT holds `params/` (Orbax), the HF `config.json` (and generation_config.json, tokenizer files)
and `jaxllm_checkpoint.json` naming the dtype, so OUT is itself a model directory.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from jaxllm.loader.hf_names import flatten_paths, unflatten_paths
from jaxllm.loader.placement import Shardings
from jaxllm.models import ModelArgs, param_shapes

MARKER = "jaxllm_checkpoint.json"


def is_orbax_checkpoint(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, MARKER))


def save_checkpoint(loaded, out_dir: str) -> str:
    """Writes a LoadedModel's params and files to out_dir as a model directory; returns it."""
    import orbax.checkpoint as ocp

    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(out_dir, "params"), loaded.params, force=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(loaded.hf_config, f, indent=1)
    if loaded.eos_token_ids:
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": sorted(loaded.eos_token_ids)}, f)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump({"dtype": jnp.dtype(loaded.dtype).name, "source": loaded.model_path}, f)
    return out_dir


def restore_params(ckpt_dir: str, args: ModelArgs, shardings: Shardings | None = None,
                   dtype=None) -> dict:
    """The params pytree, each leaf placed with shardings(path) (default device when None) and
    cast to dtype (default: the dtype it was saved in)."""
    import orbax.checkpoint as ocp

    if dtype is None:
        with open(os.path.join(ckpt_dir, MARKER)) as f:
            dtype = json.load(f)["dtype"]
    dtype = jnp.dtype(dtype)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {path: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings(path) if shardings
                                         else device)
              for path, shape in flatten_paths(param_shapes(args)).items()}
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(os.path.join(os.path.abspath(ckpt_dir), "params"),
                            unflatten_paths(target, args.num_layers))
