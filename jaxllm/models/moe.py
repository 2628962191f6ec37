"""Sparse MoE MLP (Mixtral, Qwen3-MoE, Qwen2-MoE): top-k routing and grouped expert matmuls.

Routing: softmax over all experts in fp32, top-k, renormalised when `norm_topk_prob` (Mixtral's
softmax over the top-k logits is the same thing). Expert compute: the T*k (token, expert) pairs
are sorted by expert and run as grouped matmuls, one group per expert: the Pallas kernel on a
GPU (XLA lowers `jax.lax.ragged_dot` there as a dense dot over every expert), ragged_dot
elsewhere.

Sharding (the mesh comes from the trace's abstract mesh, set by sharding.rules.ShardingPlan):
  "moe"    experts split TP-style: every device holds every expert's slice of the intermediate
           dim; partial outputs are summed over "tensor".
  "moe_ep" experts split whole across ("data", "tensor"): tokens are all-gathered over "data",
           each device runs only the pairs routed to its experts, and the combine is a
           reduce-scatter over "data" plus an all-reduce over "tensor".
Layers in `dense_layers` (Qwen's mlp_only_layers, decoder_sparse_step) use the dense MLP.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.models.args import ModelArgs
from jaxllm.models.layers import MLPS, dense_mlp
from jaxllm.models.quant import Fp8Experts, dequantize, linear
from jaxllm.sharding.axes import DATA, TENSOR
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_swiglu



def route(x: jax.Array, router: jax.Array, args: ModelArgs) -> tuple[jax.Array, jax.Array]:
    """x [T, H], router [H, E] -> (weights [T, k] in x's dtype, expert ids [T, k] int32)."""
    logits = jnp.einsum("th,he->te", x, router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, args.num_experts_per_tok)
    if args.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def _grouped_matmul(x, w, group_sizes):
    """x @ w[g] per row's group (w plain or Fp8Experts): the Pallas kernel on a GPU, ragged_dot
    (FP8 dequantised first) elsewhere."""
    if jax.default_backend() == "gpu":
        if isinstance(w, Fp8Experts):
            return grouped_matmul(x, w.values, group_sizes, w.scale)
        return grouped_matmul(x, w, group_sizes)
    return jax.lax.ragged_dot(x, _plain(w, x.dtype), group_sizes)


def _grouped_swiglu(x, w_gate, w_up, group_sizes):
    """silu(x @ w_gate[g]) * (x @ w_up[g]): one Pallas pass on GPU (faster than two grouped
    matmuls: docs/lab), ragged_dot on CPU."""
    if jax.default_backend() == "gpu":
        if isinstance(w_gate, Fp8Experts):
            return grouped_swiglu(x, w_gate.values, w_up.values, group_sizes,
                                  (w_gate.scale, w_up.scale))
        return grouped_swiglu(x, w_gate, w_up, group_sizes)
    return (jax.nn.silu(jax.lax.ragged_dot(x, _plain(w_gate, x.dtype), group_sizes))
            * jax.lax.ragged_dot(x, _plain(w_up, x.dtype), group_sizes))


def _plain(w, dtype):
    return dequantize(w, dtype) if isinstance(w, Fp8Experts) else w


def _expert_spec(w, spec: P):
    """w's shard_map spec: spec, or for FP8 experts spec for the values and [E, N] of it for the
    scale."""
    return Fp8Experts(spec, P(spec[0], spec[2])) if isinstance(w, Fp8Experts) else spec


def grouped_experts(x, weights, experts, w_gate, w_up, w_down, expert_offset):
    """SwiGLU of the experts held here, [expert_offset, expert_offset + E_local), on the pairs
    routed to them; other pairs contribute zero.

    x [T, H], weights/experts [T, k], w_gate/w_up [E_local, H, I], w_down [E_local, I, H].
    """
    num_tokens, top_k = experts.shape
    num_local = w_gate.shape[0]
    local = experts - expert_offset
    is_local = (local >= 0) & (local < num_local)
    group = jnp.where(is_local, local, num_local).reshape(-1)  # [T*k]; num_local = not here
    order = jnp.argsort(group, stable=True)
    group_sizes = jnp.bincount(group, length=num_local + 1)[:num_local].astype(jnp.int32)
    xs = x[order // top_k]  # [T*k, H] sorted by expert; rows past sum(group_sizes) give zeros
    hidden = _grouped_swiglu(xs, w_gate, w_up, group_sizes)  # [T*k, I]
    ys = _grouped_matmul(hidden, w_down, group_sizes)  # [T*k, H]
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(num_tokens, top_k, -1)
    return jnp.einsum("tkh,tk->th", y, jnp.where(is_local, weights, 0).astype(y.dtype))


def _swiglu(x, w_gate, w_up, w_down):
    return linear(jax.nn.silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def _mesh_axes() -> dict[str, int]:
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else dict(mesh.shape)


def _experts_tp(x, weights, experts, layer):
    experts_fn = partial(grouped_experts, expert_offset=0)
    if _mesh_axes().get(TENSOR, 1) == 1:
        return experts_fn(x, weights, experts, layer["experts_gate"], layer["experts_up"],
                          layer["experts_down"])
    columns, rows = P(None, None, TENSOR), P(None, TENSOR, None)
    w_gate, w_up, w_down = layer["experts_gate"], layer["experts_up"], layer["experts_down"]

    def local(x, weights, experts, w_gate, w_up, w_down):
        return jax.lax.psum(experts_fn(x, weights, experts, w_gate, w_up, w_down), TENSOR)

    specs = (_expert_spec(w_gate, columns), _expert_spec(w_up, columns),
             _expert_spec(w_down, rows))
    return jax.shard_map(local, in_specs=(P(), P(), P(), *specs), out_specs=P(),
                         check_vma=False)(x, weights, experts, w_gate, w_up, w_down)


def _experts_ep(x, weights, experts, layer):
    """Tokens sharded over "data" (DP attention) or replicated; experts whole per device."""
    axes = _mesh_axes()
    if axes.get(DATA, 1) * axes.get(TENSOR, 1) == 1:
        return _experts_tp(x, weights, experts, layer)
    tokens, split = P(DATA, None), P((DATA, TENSOR), None, None)

    def local(x, weights, experts, w_gate, w_up, w_down):
        gather = partial(jax.lax.all_gather, axis_name=DATA, tiled=True)
        rank = jax.lax.axis_index((DATA, TENSOR))
        out = grouped_experts(gather(x), gather(weights), gather(experts), w_gate, w_up, w_down,
                              rank * w_gate.shape[0])
        out = jax.lax.psum_scatter(out, DATA, scatter_dimension=0, tiled=True)
        return jax.lax.psum(out, TENSOR)

    ws = (layer["experts_gate"], layer["experts_up"], layer["experts_down"])
    return jax.shard_map(local, in_specs=(tokens, tokens, tokens,
                                          *(_expert_spec(w, split) for w in ws)),
                         out_specs=tokens, check_vma=False)(x, weights, experts, *ws)


def _moe_mlp(layer: dict, x: jax.Array, args: ModelArgs, experts_fn) -> jax.Array:
    if "router" not in layer:
        return dense_mlp(layer, x, args)
    weights, experts = route(x, layer["router"], args)
    out = experts_fn(x, weights, experts, layer)
    if "shared_gate" in layer:  # Qwen2-MoE: a dense expert behind a sigmoid gate
        shared = _swiglu(x, layer["shared_gate"], layer["shared_up"], layer["shared_down"])
        out = out + jax.nn.sigmoid(jnp.einsum("th,ho->to", x, layer["shared_expert_gate"])) * shared
    return out


def moe_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    h, e, i = args.hidden_size, args.num_experts, args.moe_intermediate_size
    shapes = {"router": (h, e), "experts_gate": (e, h, i), "experts_up": (e, h, i),
              "experts_down": (e, i, h)}
    s = args.shared_expert_intermediate_size
    if s:
        shapes.update(shared_gate=(h, s), shared_up=(h, s), shared_down=(s, h),
                      shared_expert_gate=(h, 1))
    return shapes


MLPS["moe"] = (partial(_moe_mlp, experts_fn=_experts_tp), moe_shapes)
MLPS["moe_ep"] = (partial(_moe_mlp, experts_fn=_experts_ep), moe_shapes)
