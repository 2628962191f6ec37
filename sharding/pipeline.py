"""Pipeline parallelism's placement: which layers each stage holds (vLLM's split, or
VLLM_PP_LAYER_PARTITION) and where every weight lives.

Stage s holds layers [start_s, end_s) on its own [DP, TP] mesh (sharding/mesh.stage_meshes), laid
out inside the stage by the TP rules of rules.py; the first stage also holds the embedding, the
last the final norm and the LM head (with tied embeddings, a copy of the embedding too, as vLLM's
last rank holds one).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
from jax.sharding import Mesh, NamedSharding

from jaxllm.sharding.mesh import stage_meshes
from jaxllm.sharding.rules import ShardingPlan

logger = logging.getLogger(__name__)

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"  # vLLM's: layers per stage, e.g. "6,6,4,4"


def layer_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Each stage's [start, end) layers. From VLLM_PP_LAYER_PARTITION when set; else vLLM's
    get_pp_indices split: equal shares, the remainder one each to the stages before the last,
    from the back (the last also runs the norm and LM head, the first the embedding)."""
    if num_layers < pp_size:
        raise ValueError(f"The model's number of hidden layers ({num_layers}) must be at least "
                         f"pipeline_parallel_size ({pp_size}): every stage needs a layer.")
    sizes = _partition_from_env(num_layers, pp_size)
    if sizes is None:
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            sizes[-i] += 1
        if num_layers % pp_size:
            logger.info("Hidden layers were unevenly partitioned: [%s]. This can be manually "
                        "overridden using the %s environment variable",
                        ",".join(map(str, sizes)), PARTITION_ENV)
    starts = [sum(sizes[:s]) for s in range(pp_size)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def _partition_from_env(num_layers: int, pp_size: int) -> list[int] | None:
    text = os.environ.get(PARTITION_ENV)
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"Invalid partition string: {text!r} ({PARTITION_ENV} takes the number "
                         f"of layers of each stage, e.g. \"6,6,4,4\").") from None
    if len(sizes) != pp_size:
        raise ValueError(f"{PARTITION_ENV}={text!r} has {len(sizes)} stages, but "
                         f"pipeline_parallel_size is {pp_size}.")
    if sum(sizes) != num_layers:
        raise ValueError(f"{PARTITION_ENV}={text!r} sums to {sum(sizes)} layers, but the model "
                         f"has {num_layers}.")
    if min(sizes) < 1:
        raise ValueError(f"{PARTITION_ENV}={text!r}: every stage needs at least one layer.")
    return sizes


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Per stage its layers and its ShardingPlan (TP and EP inside the stage)."""
    stages: tuple[ShardingPlan, ...]
    layers: tuple[tuple[int, int], ...]  # per stage [start, end)

    @classmethod
    def build(cls, mesh: Mesh, args, expert_parallel: bool) -> "PipelinePlan":
        """mesh: an engine's [DP, PP, TP] mesh."""
        meshes = stage_meshes(mesh)
        return cls(tuple(ShardingPlan(m, args, expert_parallel) for m in meshes),
                   tuple(layer_partition(args.num_layers, len(meshes))))

    @property
    def model_args(self):
        return self.stages[0].model_args

    def stage_of_layer(self, index: int) -> int:
        return next(s for s, (start, end) in enumerate(self.layers) if start <= index < end)

    def param_sharding(self, path: str, shape: tuple[int, ...] | None = None) -> NamedSharding:
        """The loader's placement hook: a layer's weights on its stage, the embedding on the
        first, everything else (final norm, LM head) on the last."""
        if path.startswith("layers."):
            stage = self.stage_of_layer(int(path.split(".")[1]))
        else:
            stage = 0 if path == "embed" else len(self.stages) - 1
        return self.stages[stage].param_sharding(path, shape)

    def split_params(self, params: dict) -> list[dict]:
        """The loaded params (each leaf on its stage) -> one params pytree per stage, each
        placed by its stage's plan (KV heads repeated up to TP where fewer)."""
        last = len(self.stages) - 1
        out = []
        for s, (plan, (start, end)) in enumerate(zip(self.stages, self.layers)):
            stage = {"layers": params["layers"][start:end]}
            if s == 0:
                stage["embed"] = params["embed"]
            if s == last:
                stage["final_norm"] = params["final_norm"]
                if "lm_head" in params:
                    stage["lm_head"] = params["lm_head"]
                else:  # tied: the last stage's own copy for the logits
                    stage["embed"] = jax.device_put(params["embed"], plan.param_sharding("embed"))
            out.append(plan.shard_params(stage))
        return out
