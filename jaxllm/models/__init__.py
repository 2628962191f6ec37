"""Decoder models as pure functions: `forward(params, kv_caches, batch, *, args, attn)`."""

from jaxllm.models.args import ARCHITECTURES, ModelArgs
from jaxllm.models.transformer import forward, layer_shapes, param_shapes

__all__ = ["ARCHITECTURES", "ModelArgs", "forward", "layer_shapes", "param_shapes"]
