"""PoolingEngine: the engine of a pooling model, with EngineCore's interface (add_request, step,
abort_request), so that LLM and AsyncLLM drive it as they drive generation.

One iteration schedules a batch of whole prompts, runs the pooling step, and finishes every
request in it: what the request asks on top of the model's pooled output (Matryoshka
truncation, normalisation, softmax) is applied here, on the host, per request. While requests
wait, an iteration launches the next batch before it collects the previous one, so the host's
work on both (padding the inputs, the transfer and finishing the outputs) overlaps the device's.
With LoRA (decoder models), each request may name an adapter: a step mixes the base model and up
to max_loras adapters, and keeps the slots of the step in flight (worker/pooling_runner.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.core.pooling_scheduler import PoolingRequest, PoolingScheduler
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.engine.lora_admin import LoRAAdmin
from jaxllm.engine.pooling_config import check_dimensions
from jaxllm.outputs import PoolingOutput, PoolingRequestOutput
from jaxllm.pooling_params import PoolingParams
from jaxllm.worker.pooling_runner import PoolingRunner

# task a request asks for -> the model tasks (--convert) that serve it
_SERVED_BY = {"embed": ("embed",), "classify": ("classify",), "score": ("embed", "classify"),
              "encode": ("embed", "classify")}


class PoolingEngine(LoRAAdmin):
    def __init__(self, config: EngineConfig, runner: PoolingRunner, tokenizer, *,
                 vocab_size: int, hidden_size: int) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.task = config.model_config.convert  # embed | classify
        self.pooler_config = config.pooler_config
        self.max_model_len = config.model_config.max_model_len
        self.model_name = config.model_config.served_model_name
        lora = config.lora_config
        self.scheduler = PoolingScheduler(self.max_model_len, runner.shapes,
                                          lora.max_loras if lora else None)
        self.input_processor = InputProcessor(None, self.max_model_len, vocab_size)  # ids only
        self.prompt_tokens_total = 0
        self._in_flight: tuple[list[PoolingRequest], object] | None = None
        self._aborted_in_flight: set[str] = set()
        # The last params resolved (as given, a copy to detect changes, the result): requests of
        # one batch share one PoolingParams, and share its resolution too.
        self._resolved: tuple | None = None

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    pooling_params: PoolingParams, prompt: str | None = None,
                    cache_salt: str | None = None, lora_request=None) -> None:
        """EngineCore's interface; cache_salt changes nothing here: a pooling request keeps no
        KV that another could share."""
        self.add_requests([request_id], [prompt_token_ids], [pooling_params], [lora_request])

    def add_requests(self, request_ids: list[str], prompts: list, params: list[PoolingParams],
                     lora_requests: list) -> None:
        """Many requests at once (LLM's batches): every prompt's ids checked in one numpy pass
        (per-request checks cost more host time than the GPU's forward at short prompts); a
        bad prompt is refused with the per-request check's error, and then none is added."""
        if not all(isinstance(p, PoolingParams) for p in params):
            raise ValueError("This model is a pooling model (--runner pooling): it embeds, "
                             "classifies and scores, and cannot generate text.")
        ids = [p if isinstance(p, np.ndarray) else np.asarray(list(p), np.int64) for p in prompts]
        self._check_token_ids(ids)
        resolved = [self._resolve(p) for p in params]
        for lora_request in {id(r): r for r in lora_requests if r is not None}.values():
            self.add_lora(lora_request)  # loaded now: a bad adapter is refused here
        added = []
        try:
            for request_id, prompt_ids, p, lora_request in zip(request_ids, ids, resolved,
                                                              lora_requests, strict=True):
                self.scheduler.add_request(PoolingRequest(request_id, prompt_ids, p, lora_request))
                added.append(request_id)
        except Exception:
            self.scheduler.abort(added)
            raise
        self.prompt_tokens_total += sum(map(len, ids))

    def _check_token_ids(self, ids: list[np.ndarray]) -> None:
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.concatenate(ids) if ids else lengths
        if ((lengths == 0) | (lengths > self.max_model_len)).any() or (
                flat.size and (flat.min() < 0 or flat.max() >= self.input_processor.vocab_size)):
            for prompt_ids in ids:  # the first bad prompt's own error
                self.input_processor.process(prompt_ids)

    def _resolve(self, params: PoolingParams) -> PoolingParams:
        """The request's params with the model's defaults filled in, checked against the model
        (the same object for requests given the same unchanged params)."""
        last = self._resolved
        if last is not None and params is last[0] and params == last[1]:
            return last[2]
        resolved = self._resolve_new(params)
        self._resolved = (params, dataclasses.replace(params), resolved)
        return resolved

    def _resolve_new(self, params: PoolingParams) -> PoolingParams:
        task = params.task or self.task
        if self.task not in _SERVED_BY[task]:
            raise ValueError(f"The {task} task is not supported by this model, which is served "
                             f"for {self.task} (--convert {self.task}).")
        if self.pooler_config.pooling_type == "ALL" and task != "encode":
            raise ValueError(f"The {task} task needs one vector per prompt; this model pools "
                             "ALL tokens (encode only).")
        pooler = self.pooler_config
        dimensions = params.dimensions or pooler.dimensions
        if params.dimensions is not None:
            check_dimensions(params.dimensions, self.config.model_config.hf_config,
                             self.model_name, self.hidden_size)
        return dataclasses.replace(
            params, task=task, dimensions=dimensions,
            normalize=pooler.normalize if params.normalize is None else params.normalize,
            use_activation=(pooler.use_activation if params.use_activation is None
                            else params.use_activation))

    def abort_request(self, request_ids) -> None:
        self.scheduler.abort(request_ids)
        if self._in_flight is not None:
            in_flight = {r.request_id for r in self._in_flight[0]}
            self._aborted_in_flight.update(i for i in request_ids if i in in_flight)

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    # -- one iteration --------------------------------------------------------------------------
    def step(self) -> list[PoolingRequestOutput]:
        """Launches the next batch, then finishes the one launched before (or this one, when
        nothing waits behind it)."""
        held = self._in_flight[0] if self._in_flight is not None else []
        batch = self.scheduler.schedule({r.lora_int_id for r in held})
        launched = ((batch, self.runner.launch(batch, {r.lora_slot for r in held}))
                    if batch else None)
        done, self._in_flight = self._in_flight, launched
        if done is None and not self.scheduler.has_unfinished_requests():
            done, self._in_flight = self._in_flight, None
        if done is None:
            return []
        batch, pooled = done[0], self.runner.collect(*done)
        aborted, self._aborted_in_flight = self._aborted_in_flight, set()
        pooled = self._finish_batch(pooled, [r.pooling_params for r in batch])
        return [PoolingRequestOutput(r.request_id, PoolingOutput(x), r.prompt_token_ids)
                for r, x in zip(batch, pooled) if r.request_id not in aborted]

    def _finish_batch(self, pooled, params: list[PoolingParams]):
        """_finish per request, or once over the batch's rows when they share their params
        (the common case, and per-row numpy calls cost more than the step's forward). pooled:
        the runner's collect."""
        if params and not self.runner.per_token and all(p is params[0] for p in params):
            return self._finish(pooled, params[0])
        return [self._finish(x, p) for x, p in zip(pooled, params)]

    def _finish(self, pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
        """Embeddings: the first `dimensions` values, L2-normalised; class logits: softmax (one
        label: sigmoid), each when asked."""
        if self.task == "embed":
            if params.dimensions is not None:
                pooled = pooled[..., :params.dimensions]
            if params.normalize:
                norm = np.linalg.norm(pooled, axis=-1, keepdims=True)
                pooled = pooled / np.maximum(norm, 1e-12)
            return pooled
        if not params.use_activation:
            return pooled
        if pooled.shape[-1] == 1:
            return 1.0 / (1.0 + np.exp(-pooled))
        shifted = np.exp(pooled - pooled.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)

    def get_stats(self) -> dict:
        """EngineCore's stats; a pooling model holds no KV cache."""
        return {"num_running": 0, "num_waiting": len(self.scheduler.waiting),
                "kv_cache_usage": 0.0, "num_preemptions_total": 0, "num_free_blocks": 0,
                "num_blocks": 0, "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": 0}
