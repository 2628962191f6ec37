"""`jaxllm bench throughput`: offline engine throughput over a dataset, beside its roofline.

Prints vLLM's line: `Throughput: X requests/s, Y total tokens/s, Z output tokens/s`.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxllm.bench import roofline, spec_decode
from jaxllm.bench.datasets import (ConversationHistory, SampleRequest, add_dataset_args,
                                   conversations, sample_requests)
from jaxllm.sampling_params import SamplingParams


def add_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser, input_len=1024, output_len=128, num_prompts=1000, seed_flag=False)
    add_engine_args(parser)
    parser.add_argument("--output-json", default=None, help="write the results here as JSON")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from jaxllm.engine.args import EngineArgs

    parser.add_argument("--model", default=None,
                        help="a local HF model directory, a .gguf file, or with "
                             "--load-format dummy a preset name (llama-3.1-8b, ...)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip measuring the device ceilings and the floor line")
    parser.add_argument("--disable-tqdm", action="store_true")
    EngineArgs.add_cli_args(parser)


def make_llm(args: argparse.Namespace):
    from jaxllm.engine.args import EngineArgs
    from jaxllm.engine.llm import LLM

    return LLM(**vars(EngineArgs.from_cli_args(args)))


def engine_prompt(request: SampleRequest):
    if isinstance(request.prompt, str):
        return request.prompt
    return {"prompt_token_ids": request.prompt}


def _params(requests: list[SampleRequest]) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True,
                           max_tokens=r.expected_output_len) for r in requests]


def _run_conversations(llm, requests: list[SampleRequest], use_tqdm: bool) -> list:
    """Multi-turn: every conversation's turn k in one batch, then turn k + 1 with each
    conversation so far (outputs included) as its prompt."""
    turns = conversations(requests)
    history, outputs = ConversationHistory(), []
    for k in range(max(map(len, turns))):
        batch = [t[k] for t in turns if k < len(t)]
        prompts = [history.prompt(r) for r in batch]
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(batch),
                               use_tqdm=use_tqdm)
        for request, prompt, result in zip(batch, prompts, results):
            history.record(request, prompt, result.outputs[0].token_ids)
        outputs += results
    return outputs


def run_throughput(llm, requests: list[SampleRequest], use_tqdm: bool = True) -> dict:
    """Generates every request's expected_output_len tokens (ignore_eos); returns vLLM's keys."""
    start = time.perf_counter()
    if requests[0].conversation is None:
        outputs = llm.generate([engine_prompt(r) for r in requests], _params(requests),
                               use_tqdm=use_tqdm)
    else:
        outputs = _run_conversations(llm, requests, use_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"elapsed_time": elapsed, "num_requests": len(requests),
            "total_num_tokens": prompt_tokens + output_tokens,
            "total_prompt_tokens": prompt_tokens, "total_output_tokens": output_tokens,
            "requests_per_second": len(requests) / elapsed,
            "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
            "output_tokens_per_second": output_tokens / elapsed}


def format_result(result: dict) -> str:
    return (f"Throughput: {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s, "
            f"{result['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {result['total_prompt_tokens']}\n"
            f"Total num output tokens:  {result['total_output_tokens']}")


def add_floor(result: dict, args: argparse.Namespace, requests: list[SampleRequest],
              ceilings: roofline.Ceilings, max_num_seqs: int,
              storage: roofline.Storage) -> str:
    """Adds the workload's floor to `result` (the engine's elements stored as `storage`);
    returns the printed line."""
    model_args = roofline.model_args_of(args.model, args.load_format)
    floor = roofline.workload_floor(model_args, [r.prompt_len for r in requests],
                                    [r.expected_output_len for r in requests], max_num_seqs,
                                    ceilings, storage)
    result.update(roofline=floor, ceilings=ceilings.as_dict(),
                  fraction_of_floor=floor["floor_s"] / result["elapsed_time"])
    return "Roofline: " + roofline.describe(floor, result["elapsed_time"])


def main(args: argparse.Namespace) -> dict:
    llm = make_llm(args)
    requests = sample_requests(args, llm.get_tokenizer(), llm.input_processor.vocab_size)
    result = run_throughput(llm, requests, use_tqdm=not args.disable_tqdm)
    print(format_result(result), flush=True)
    spec_decode.report(result, llm.llm_engine.get_stats())
    if not args.no_roofline:
        ceilings = measure_ceilings_for(args)
        print(add_floor(result, args, requests, ceilings, args.max_num_seqs,
                        roofline.Storage.of_engine(llm.llm_engine.config)), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def measure_ceilings_for(args: argparse.Namespace) -> roofline.Ceilings:
    """The ceilings, in the engine's dtype, of all the devices the engine runs on (DP x PP x TP
    of one measured device): an offline workload keeps every DP replica and, with PP batches in
    flight, every pipeline stage busy at once."""
    return measure_device_ceilings(args).times(
        args.tensor_parallel_size * args.data_parallel_size * args.pipeline_parallel_size)


def measure_device_ceilings(args: argparse.Namespace) -> roofline.Ceilings:
    """One device's ceilings in the engine's dtype."""
    from jaxllm.loader.loader import resolve_dtype
    return roofline.measure_ceilings(resolve_dtype(args.dtype).name)
