"""Pipeline parallelism at run time: one program per stage, each on its own stage's devices.

In single-controller JAX a program's inputs share one device set, so a step over PP stages is PP
programs: every stage before the last runs `stage_step` (the first embeds the tokens, each runs
its layers over its own KV cache) and its activations [T, H] move to the next stage's devices
with one device_put; the last stage runs the ordinary jitted step (worker/step.py), whose model
function runs its layers over the activations handed to it (STAGE_INPUT in its params), then the
final norm, LM head and sampler. Dispatch is asynchronous, so while stage s runs one batch stage
s - 1 can run the next (the engine keeps PP batches in flight: engine_core.py).

Every stage unpacks the same packed inputs (each gets its own host-to-device copy); placeholder
tokens never reach a pipeline (the scheduler holds back a request whose last token is in flight,
scheduler.py), so the first stage needs nothing from the last.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.models.transformer import embed_tokens, final_outputs, run_layers
from jaxllm.sharding.axes import DATA
from jaxllm.worker.kv_cache import cache_views, kept_as
from jaxllm.worker.packing import PackLayout, unpack
from jaxllm.worker.step import replicated

STAGE_INPUT = "stage_input"  # the last stage's step params: the previous stage's activations


def stage_forward(params: dict, kv_caches, batch, *, args, attn, write_kv, x=None):
    """A stage before the last: the embedding when it is the first (x None), then its layers
    -> (activations [T, H], kv_caches)."""
    if x is None:
        x = embed_tokens(params, batch)
    return run_layers(params["layers"], kv_caches, x, batch, args=args, attn=attn,
                      write_kv=write_kv)


def last_stage_forward(params: dict, kv_caches, batch, *, args, attn, write_kv,
                       return_hidden: bool = False):
    """The last stage as the step's model function (forward's outputs): its layers over the
    activations in params[STAGE_INPUT], then the final norm and the logits."""
    x, kv_caches = run_layers(params["layers"], kv_caches, params[STAGE_INPUT], batch, args=args,
                              attn=attn, write_kv=write_kv)
    return final_outputs(params, x, batch, kv_caches, args=args, return_hidden=return_hidden)


def activation_sharding(mesh: Mesh) -> NamedSharding:
    """Activations [T, H] on a stage: replicated over "tensor", split over "data" under DP
    attention (each rank's tokens on its own devices)."""
    return NamedSharding(mesh, P(DATA if mesh.shape[DATA] > 1 else None, None))


@dataclass(frozen=True)
class StageModel:
    """The static part of a stage program."""
    forward: Callable  # stage_forward bound to the stage's mesh (ShardingPlan.model_fn)
    activations: NamedSharding  # where its output activations live

    @property
    def mesh(self) -> Mesh:
        return self.activations.mesh


@partial(jax.jit, donate_argnames=("kv_caches",), static_argnames=("model", "layout"))
def stage_step(params, kv_caches, packed_inputs: jax.Array, x, *, model: StageModel,
               layout: PackLayout):
    """One stage before the last: x None on the first -> (activations, kv_caches)."""
    batch = replicated(unpack(packed_inputs, layout), model.mesh).batch
    x, new_caches = model.forward(params, cache_views(kv_caches), batch, x=x)
    return jax.lax.with_sharding_constraint(x, model.activations), kept_as(new_caches, kv_caches)


@dataclass
class FrontStage:
    """A stage before the last, as the builder makes it."""
    params: dict
    model_fn: Callable  # (params, kv_caches, batch, x=...) -> (x, kv_caches)
    kv_caches: list  # per layer (k_cache, v_cache) on the stage's devices
    mesh: Mesh


class Pipeline:
    """The stages before the last: runs them for a step and hands the last stage's step its
    params. The ModelRunner keeps the last stage (its params, KV cache, sampler state)."""

    def __init__(self, front: list[FrontStage], last_mesh: Mesh) -> None:
        self.stages = front
        self.models = [StageModel(jax.jit(s.model_fn), activation_sharding(s.mesh))
                       for s in front]
        self.last_activations = activation_sharding(last_mesh)
        embed = front[0].params["embed"]
        self.hidden_size, self.dtype = embed.shape[1], embed.dtype
        self._compiled: dict = {}  # (stage index, packed-input layout) -> its executable

    def step_params(self, last_params: dict, packed, layout: PackLayout) -> dict:
        """Dispatches every stage before the last (without waiting) and returns the last
        stage's step params with the activations on its devices."""
        x = None
        for index, stage in enumerate(self.stages):
            if x is not None:
                x = jax.device_put(x, self.models[index].activations)
            compiled = self._compiled.get((index, layout))
            if compiled is not None:
                x, stage.kv_caches = compiled(stage.params, stage.kv_caches, packed, x)
            else:
                x, stage.kv_caches = stage_step(stage.params, stage.kv_caches, packed, x,
                                                model=self.models[index], layout=layout)
        return {**last_params, STAGE_INPUT: jax.device_put(x, self.last_activations)}

    def lowering_params(self, last_params: dict, layout: PackLayout) -> dict:
        """The last stage's step params for lowering its program: the activations abstract."""
        return {**last_params, STAGE_INPUT: self._activations(layout, self.last_activations)}

    def _activations(self, layout: PackLayout, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        shapes = jax.tree.unflatten(layout.treedef, [shape for _, shape, _ in layout.entries])
        num_tokens = shapes.batch.token_ids[0]
        return jax.ShapeDtypeStruct((num_tokens, self.hidden_size), self.dtype, sharding=sharding)

    def warmup(self, packed_layouts: list, pool: Executor) -> None:
        """Compiles every stage's program for each (packed inputs, layout) in the pool."""
        futures = {}
        for packed, layout in packed_layouts:
            for index, stage in enumerate(self.stages):
                x = (None if index == 0
                     else self._activations(layout, self.models[index].activations))
                lowered = stage_step.lower(stage.params, stage.kv_caches, packed, x,
                                           model=self.models[index], layout=layout)
                futures[index, layout] = pool.submit(lowered.compile)
        self._compiled.update({key: future.result() for key, future in futures.items()})

