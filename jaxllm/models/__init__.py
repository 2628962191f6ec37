"""Decoder models as pure functions: `forward(params, kv_caches, batch, *, args, attn)`."""

from jaxllm.models.args import ARCHITECTURES, ModelArgs
from jaxllm.models.fused import fuse_params
from jaxllm.models.transformer import compute_logits, forward, layer_shapes, param_shapes

__all__ = ["ARCHITECTURES", "ModelArgs", "compute_logits", "forward", "fuse_params",
           "layer_shapes", "param_shapes"]
