"""The offline API of pooling models, as vLLM's: LLM.embed(), .classify(), .score(), .encode()."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxllm.engine.pooling_engine import PoolingEngine
from jaxllm.engine.pooling_inputs import (cosine, cross_encoder_score, pair_inputs, pair_params,
                                          prompt_token_ids, score_pairs, truncation_length)
from jaxllm.lora.request import LoRARequest, per_prompt
from jaxllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,
                            PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from jaxllm.pooling_params import PoolingParams

PoolingPrompt = str | list[int] | dict[str, Any]
LoRARequests = LoRARequest | Sequence[LoRARequest | None] | None


class PoolingAPI:
    """Mixed into LLM; needs its llm_engine, _request_counter, _as_prompt_list, _run_engine.
    lora_request (decoder models, enable_lora=True): one adapter for every prompt, or one (or
    None) per prompt, as LLM.generate's."""

    def embed(self, prompts: PoolingPrompt | Sequence[PoolingPrompt], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: LoRARequests = None) -> list[EmbeddingRequestOutput]:
        outputs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm,
                             lora_request)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def classify(self, prompts: PoolingPrompt | Sequence[PoolingPrompt], *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request: LoRARequests = None) -> list[ClassificationRequestOutput]:
        outputs = self._pool(prompts, pooling_params, "classify", truncate_prompt_tokens,
                             use_tqdm, lora_request)
        return [ClassificationRequestOutput.from_base(output) for output in outputs]

    def encode(self, prompts: PoolingPrompt | Sequence[PoolingPrompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str = "encode",
               lora_request: LoRARequests = None) -> list[PoolingRequestOutput]:
        return self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens,
                          use_tqdm, lora_request)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Embedding models: the cosine similarity of the two texts' embeddings; cross-encoders
        (a classifier with one label): its output on the pair. 1 x N or N x N pairs; every text
        with lora_request's adapter."""
        texts_1 = [data_1] if isinstance(data_1, str) else list(data_1)
        texts_2 = [data_2] if isinstance(data_2, str) else list(data_2)
        pairs = score_pairs(texts_1, texts_2)
        engine = self._pooling_engine("score")
        if engine.task == "embed":
            embeddings = self._pool(texts_1 + texts_2, pooling_params, "embed",
                                    truncate_prompt_tokens, use_tqdm, lora_request)
            first, second = embeddings[:len(texts_1)], embeddings[len(texts_1):]
            return [ScoringRequestOutput(second[j].request_id, ScoringOutput(cosine(
                first[i].outputs.data, second[j].outputs.data)),
                first[i].prompt_token_ids + second[j].prompt_token_ids) for i, j in pairs]
        max_length = truncation_length(truncate_prompt_tokens, engine.max_model_len)
        inputs = [pair_inputs(engine.tokenizer, texts_1[i], texts_2[j], max_length)
                  for i, j in pairs]
        outputs = self._run_pooling([ids for ids, _ in inputs], list,
                                    [pair_params(pooling_params, start) for _, start in inputs],
                                    use_tqdm, [lora_request] * len(inputs))
        return [ScoringRequestOutput(o.request_id, ScoringOutput(cross_encoder_score(
            o.outputs.data)), o.prompt_token_ids) for o in outputs]

    # -- helpers --------------------------------------------------------------------------------
    def _pooling_engine(self, task: str) -> PoolingEngine:
        if not isinstance(self.llm_engine, PoolingEngine):
            raise ValueError(f"LLM.{task}() is only supported for pooling models. Try passing "
                             f"`--runner pooling` to use the model as a pooling model.")
        return self.llm_engine

    def _pool(self, prompts, pooling_params, task: str, truncate_prompt_tokens: int | None,
              use_tqdm: bool, lora_request: LoRARequests) -> list[PoolingRequestOutput]:
        engine = self._pooling_engine(task)
        prompts = self._as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and pooling_params "
                             f"({len(pooling_params)}) must be the same.")
        truncate = truncate_prompt_tokens
        keep = [truncation_length(truncate if truncate is not None else p.truncate_prompt_tokens,
                                  engine.max_model_len) for p in pooling_params]
        with_task = {id(p): PoolingParams(**{**vars(p), "task": task}) for p in pooling_params}
        params = [with_task[id(p)] for p in pooling_params]  # shared, as the caller's were
        return self._run_pooling(
            list(zip(prompts, keep)), lambda prompt_keep: prompt_token_ids(engine.tokenizer,
                                                                           *prompt_keep),
            params, use_tqdm, per_prompt(lora_request, len(prompts)))

    def _run_pooling(self, prompts: list, to_ids: Callable[[Any], Any],
                     params: list[PoolingParams], use_tqdm: bool,
                     lora_requests: list[LoRARequest | None]) -> list[PoolingRequestOutput]:
        """Runs the prompts (each made token ids by to_ids), added a step's worth at a time
        while the engine keeps two steps' worth waiting: making and checking the ids of the
        prompts behind overlaps the device's work on those ahead. A bad prompt raises after
        the steps before it ran, and nothing of the call stays in the engine."""
        engine = self.llm_engine
        request_ids = [str(next(self._request_counter)) for _ in prompts]
        step_rows = engine.config.scheduler_config.max_num_seqs
        added = 0

        def feed() -> bool:
            nonlocal added
            while added < len(prompts) and len(engine.scheduler.waiting) < 2 * step_rows:
                end = min(added + step_rows, len(prompts))
                engine.add_requests(request_ids[added:end],
                                    [to_ids(prompt) for prompt in prompts[added:end]],
                                    params[added:end], lora_requests[added:end])
                added = end
            return added < len(prompts)
        return self._run_engine(request_ids, use_tqdm, feed)
