"""The offline API, shaped as vLLM's: LLM(...).generate(prompts, sampling_params) and .chat();
for pooling models .embed(), .classify(), .score(), .encode() (engine/llm_pooling.py)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from jaxllm.engine.args import EngineArgs
from jaxllm.engine.builder import make_engine
from jaxllm.engine.llm_pooling import PoolingAPI
from jaxllm.engine.pooling_engine import PoolingEngine
from jaxllm.engine.input_processor import InputProcessor
from jaxllm.lora.request import LoRARequest, per_prompt
from jaxllm.outputs import RequestOutput
from jaxllm.sampling_params import RequestOutputKind, SamplingParams

# A dict is vLLM's TextPrompt / TokensPrompt: "prompt" and/or "prompt_token_ids", and an optional
# "cache_salt" (requests share cached KV only under the same salt).
PromptType = str | list[int] | dict[str, Any]


class LLM(PoolingAPI):
    """LLM(model=None) serves the built-in default model (SmolLM2-135M-Instruct).

    Keyword arguments are EngineArgs' fields (vLLM's names): dtype, max_model_len,
    gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, block_size, seed, ...
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = make_engine(self.engine_args)
        self.input_processor = InputProcessor(self.llm_engine.tokenizer,
                                              self.llm_engine.max_model_len,
                                              self.llm_engine.vocab_size)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False while requests hold KV blocks (as vLLM)."""
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None) per prompt; the engine
        needs enable_lora=True."""
        if isinstance(self.llm_engine, PoolingEngine):
            raise ValueError("LLM.generate() is only supported for generative models. Try "
                             "passing `--runner generate` to use the model as a generative model.")
        prompts = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"The lengths of prompts ({len(prompts)}) and sampling_params "
                             f"({len(sampling_params)}) must be the same.")
        lora_requests = per_prompt(lora_request, len(prompts))
        request_ids = []
        try:
            for prompt, params, lora in zip(prompts, _final_only(sampling_params), lora_requests):
                processed = self.input_processor.process(prompt)
                request_id = str(next(self._request_counter))
                cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                self.llm_engine.add_request(request_id, processed.token_ids, params,
                                            prompt=processed.text, cache_salt=cache_salt,
                                            lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)  # nothing may leak
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            processed = self.input_processor.from_chat(
                conversation, add_generation_prompt, chat_template=chat_template)
            prompts.append({"prompt": processed.text, "prompt_token_ids": processed.token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run_engine(self, request_ids: list[str], use_tqdm: bool,
                    feed: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """Steps the engine until request_ids finish. feed(), called before each step, adds
        more of them (True while some are still to come)."""
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while (feed is not None and feed()) or self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self.llm_engine.abort_request([r for r in request_ids if r not in finished])
            raise
        finally:
            bar.close()
        return [finished[r] for r in request_ids]


def _final_only(sampling_params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """Copies asking for the final output only (LLM.generate returns nothing else, so no output
    is built per step); one copy per distinct object."""
    copies: dict[int, SamplingParams] = {}
    for params in sampling_params:
        if id(params) not in copies:
            copies[id(params)] = dataclasses.replace(
                params, output_kind=RequestOutputKind.FINAL_ONLY)
    return [copies[id(params)] for params in sampling_params]
