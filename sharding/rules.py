"""Partition rules: every param path and the KV cache -> a PartitionSpec on the ("data", "tensor")
mesh, and the ShardingPlan an engine uses to place weights, allocate its KV cache and wrap its step.

Megatron layout over "tensor": q/k/v and gate/up are split by output columns (whole heads), wo and
down by input rows, so each layer needs one all-reduce after attention and one after the MLP
(GSPMD inserts them). Embedding and LM head are vocab-parallel. Where KV heads < TP, every device
still needs its own KV head: wk/wv are loaded replicated, then their heads are repeated TP/KV
times (`expand_kv_heads`) so that each device holds the one head its query heads use, and the KV
cache gets TP heads (vLLM replicates the same way).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.models.quant import map_out, shard_weight
from jaxllm.sharding.axes import DATA, TENSOR

T = TENSOR
_COLUMN = ("wq", "bq", "w_gate", "w_up", "shared_gate", "shared_up")  # output dim split
_ROW = ("wo", "w_down", "shared_down")  # input dim split
_KV = ("wk", "bk", "wv", "bv")
_EXPERTS = ("experts_gate", "experts_up", "experts_down")  # [E, H, I] / [E, I, H]
# The compute layout (jaxllm/models/fused.py): wqkv [H, Hkv, G + 2, D], bqkv [Hkv, G + 2, D]
# split by KV head (whole groups a device; KV heads were repeated up to TP where fewer),
# w_gate_up [H, 2, I] by I.
_FUSED = {"wqkv": P(None, T, None, None), "bqkv": P(T, None, None), "w_gate_up": P(None, None, T)}


def _layer_spec(name: str, ndim: int, kv_sharded: bool, expert_parallel: bool) -> P:
    if name in _FUSED:
        return _FUSED[name]
    if name in _COLUMN or (name in _KV and kv_sharded):
        return P(*([None] * (ndim - 1)), T)
    if name in _ROW:
        return P(T, None)
    if name in _EXPERTS:
        if expert_parallel:
            return P((DATA, T), None, None)  # whole experts per device
        return P(None, T, None) if name == "experts_down" else P(None, None, T)
    return P()  # norms, bo, router, shared_expert_gate; wk/wv when KV heads < TP


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    mesh: Mesh
    args: object  # ModelArgs of the checkpoint (before expand_kv_heads)
    expert_parallel: bool = False

    @property
    def tp(self) -> int:
        return self.mesh.shape[T]

    @property
    def kv_sharded(self) -> bool:
        return self.args.num_kv_heads >= self.tp

    @property
    def model_args(self):
        """The args the sharded step runs with: KV heads repeated up to TP, the EP MoE kind."""
        args = self.args
        if not self.kv_sharded:
            args = dataclasses.replace(args, num_kv_heads=self.tp)
        if self.expert_parallel and args.num_experts:
            args = dataclasses.replace(args, mlp_kind="moe_ep")
        return args

    # -- params ------------------------------------------------------------------------------
    def spec(self, path: str, ndim: int | None = None) -> P:
        """path: "embed", "lm_head", "final_norm" or "layers.<i>.<name>" (loader paths)."""
        if path == "embed":
            return P(T, None)
        if path == "lm_head":
            return P(None, T)
        if not path.startswith("layers."):
            return P()
        name = path.split(".")[2]
        if ndim is None:
            ndim = 1 if name.startswith("b") or name.endswith("norm") else (
                3 if name in _EXPERTS else 2)
        return _layer_spec(name, ndim, self.kv_sharded, self.expert_parallel)

    def param_sharding(self, path: str, shape: tuple[int, ...] | None = None) -> NamedSharding:
        """The loader's placement hook: each device receives only its own shard of `path` (for a
        quantised weight, the sharding of the plain matrix it stands for: quant.shard_weight)."""
        return NamedSharding(self.mesh, self.spec(path, None if shape is None else len(shape)))

    def shard_params(self, params: dict) -> dict:
        """Places (or re-places) a params pytree per the rules, repeating KV heads if needed."""
        out = {k: shard_weight(v, self.param_sharding(k, v.shape))
               for k, v in params.items() if k != "layers"}
        out["layers"] = [self._shard_layer(i, layer) for i, layer in enumerate(params["layers"])]
        return out

    def _shard_layer(self, index: int, layer: dict) -> dict:
        placed = {}
        for name, value in layer.items():
            sharding = self.param_sharding(f"layers.{index}.{name}", value.shape)
            if name in _KV and not self.kv_sharded:
                column = NamedSharding(self.mesh, P(*([None] * (len(value.shape) - 1)), T))
                expanded = _expand(value, self.args.num_kv_heads, self.tp)
                placed[name] = shard_weight(expanded, column)
            else:
                placed[name] = shard_weight(value, sharding)
        return placed

    # -- KV cache and step ---------------------------------------------------------------------
    @property
    def kv_cache_sharding(self) -> NamedSharding:
        """[DP * N, Hkv, P, D]: by KV head, and by DP rank (each rank's own pool) under DP
        attention."""
        return NamedSharding(self.mesh, P(_data_axis(self.mesh), T, None, None))

    def model_fn(self, forward: Callable, attn: Callable, write_kv: Callable) -> Callable:
        """forward bound to the sharded args, with attention and KV write run per device."""
        mesh, args = self.mesh, self.model_args
        attn_sharded, write_sharded = shard_attention(attn, write_kv, mesh)
        tokens = NamedSharding(mesh, P(DATA))

        def model_fn(params, kv_caches, batch, **kwargs):
            if _data_axis(mesh):  # DP attention: each rank's tokens stay on its own devices
                batch = dataclasses.replace(
                    batch, token_ids=jax.lax.with_sharding_constraint(batch.token_ids, tokens),
                    positions=jax.lax.with_sharding_constraint(batch.positions, tokens))
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # MoE reads the mesh
                return forward(params, kv_caches, batch, args=args, attn=attn_sharded,
                               write_kv=write_sharded, **kwargs)
        return model_fn


@partial(jax.jit, static_argnums=(1, 2))
def _expand(w, num_kv_heads: int, tp: int):
    """expand_kv_heads over the output axis of a plain or quantised weight."""
    return map_out(partial(expand_kv_heads, num_kv_heads=num_kv_heads, tp=tp), [w])


def expand_kv_heads(w: jax.Array, num_kv_heads: int, tp: int) -> jax.Array:
    """[..., Hkv * D] -> [..., TP * D]: head j of the result is head j // (TP / Hkv)."""
    head_dim = w.shape[-1] // num_kv_heads
    heads = w.reshape(*w.shape[:-1], num_kv_heads, head_dim)
    return jnp.repeat(heads, tp // num_kv_heads, axis=-2).reshape(*w.shape[:-1], tp * head_dim)


def _data_axis(mesh: Mesh) -> str | None:
    """"data" when the mesh's DP ranks run in one program (DP attention), else None: a [1, TP]
    replica keeps the specs it always had."""
    return DATA if mesh.shape[DATA] > 1 else None


def shard_attention(attn: Callable, write_kv: Callable, mesh: Mesh) -> tuple[Callable, Callable]:
    """Attention and KV write per device, on its own heads of its own DP rank: tokens, sequence
    metadata and KV pool are split rank-major over "data" (block ids, slot mappings and
    cu_q_lens are local to the rank), heads over "tensor". The Pallas kernel cannot be
    auto-partitioned; for the XLA path this also keeps the page gathers local."""
    dp = _data_axis(mesh)
    heads, cache = P(dp, T, None), P(dp, T, None, None)  # [T, H, D], [N, Hkv, P, D]
    rows, table = P(dp), P(dp, None)  # [T] / [S] / [S + 1] / [1] per rank, [S, B] per rank

    def attn_sharded(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs, **kw):
        local = jax.shard_map(partial(attn, **kw), mesh=mesh,
                              in_specs=(heads, cache, cache, rows, table, rows, rows),
                              out_specs=heads, check_vma=False)
        return local(q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs)

    def write_sharded(k_cache, v_cache, k, v, slot_mapping):
        local = jax.shard_map(write_kv, mesh=mesh, in_specs=(cache, cache, heads, heads, rows),
                              out_specs=(cache, cache), check_vma=False)
        return local(k_cache, v_cache, k, v, slot_mapping)

    return attn_sharded, write_sharded
