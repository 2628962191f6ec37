"""n-gram acceptance on the default model (SmolLM2-135M-Instruct, real weights; CPU is fine):
acceptance rate and mean acceptance length for k = 3, 4, 5 on (a) rewrite / edit prompts whose
answer repeats the prompt and (b) plain chat; greedy, and each output checked token for token
against the same engine without speculation.

    JAX_PLATFORMS=cpu python benchmarks/spec_decode_acceptance.py [--max-tokens 128]
    python benchmarks/spec_decode_acceptance.py --model FILE.gguf --tpot     # on a GPU

--tpot adds batch-1 TPOT on each workload, as vLLM defines it (time from the first output token
to the last, over the tokens after the first), each prompt alone, without speculation and with
each k, after a warm-up pass that compiles every shape the timed pass uses; the figure is the
workload's total over its prompts (the mean over output tokens).

One speculating engine serves every k (its proposer's k is lowered; the runner verifies any
number of drafts up to the configured 5).
"""

from __future__ import annotations

import argparse
import json
import time

from jaxllm import LLM, SamplingParams
from jaxllm.bench.spec_decode import spec_decode_metrics

_PASSAGE = ("The committee have met on tuesday to discussed the new budget, which were "
            "approved after a long debate. Members agreed that the fund for the library "
            "should be increase by ten percent, and that the park renovation will be delay "
            "until next spring because the contractor are not available.")
_CODE = '''def average(x):
    total = 0
    for v in x:
        total = total + v
    if len(x) == 0:
        return 0
    return total / len(x)


def maximum(x):
    best = x[0]
    for v in x:
        if v > best:
            best = v
    return best
'''
WORKLOADS = {
    "rewrite": [
        f"Fix the grammar of this paragraph and return the corrected paragraph:\n\n{_PASSAGE}",
        f"Rename the parameter `x` to `values` everywhere and return the full code:\n\n{_CODE}",
        f"Repeat the following text exactly, then say DONE:\n\n{_PASSAGE}",
        f"Add a docstring to each function and return the full code:\n\n{_CODE}",
    ],
    "chat": [
        "What is the capital of France?",
        "Give me three tips for sleeping better.",
        "Explain photosynthesis to a ten year old.",
        "Write a short poem about the sea.",
    ],
}
KS = (3, 4, 5)


def stats_delta(after: dict, before: dict) -> dict:
    return {k: ([a - b for a, b in zip(v, before[k])] if isinstance(v, list) else v - before[k])
            for k, v in after.items() if k.startswith("spec_decode")}


def batch1_tpot_ms(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    """ms per output token after each request's first, each prompt alone (a warm-up pass
    first): summed over the workload's prompts."""
    engine = llm.llm_engine
    token_ids = [llm.input_processor.from_chat([{"role": "user", "content": p}], True).token_ids
                 for p in prompts]
    for timed in (False, True):
        elapsed, tokens = 0.0, 0
        for i, prompt in enumerate(token_ids):
            engine.add_request(f"tpot-{timed}-{i}", prompt, params)
            times, num_tokens = [], 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    times.append(time.perf_counter())
                    num_tokens = len(out.outputs[0].token_ids)
            elapsed, tokens = elapsed + times[-1] - times[0], tokens + num_tokens - 1
        if timed:
            return elapsed * 1e3 / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--tpot", action="store_true", help="also time batch-1 decode")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine_args = dict(model=args.model, max_model_len=1024, max_num_batched_tokens=256,
                       enforce_eager=True, compilation_cache_dir=None, dtype=args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain = LLM(**engine_args)
    expected = {name: [o.outputs[0].token_ids for o in plain.chat(
        [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)]
        for name, prompts in WORKLOADS.items()}
    tpot = {name: {"plain": batch1_tpot_ms(plain, prompts, params)}
            for name, prompts in WORKLOADS.items()} if args.tpot else {}
    del plain
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": max(KS),
                                   "prompt_lookup_min": args.prompt_lookup_min,
                                   "prompt_lookup_max": args.prompt_lookup_max}, **engine_args)
    engine, results = spec.llm_engine, {}
    for k in KS:
        engine.proposer.k = k
        for name, prompts in WORKLOADS.items():
            before = engine.get_stats()
            outputs = spec.chat([[{"role": "user", "content": p}] for p in prompts], params,
                                use_tqdm=False)
            metrics = spec_decode_metrics(stats_delta(engine.get_stats(), before))
            got = [o.outputs[0].token_ids for o in outputs]
            metrics["same_tokens_as_plain"] = got == expected[name]
            # per prompt: the tokens before the first that differs from plain decode's
            metrics["tokens_as_plain"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b),
                                               min(len(x), len(y)))
                                          for x, y in zip(got, expected[name])]
            results[f"{name} k={k}"] = metrics
            print(f"{name:8s} k={k}: acceptance rate {metrics['acceptance_rate']:.1%}, mean "
                  f"acceptance length {metrics['mean_acceptance_length']:.2f}, same tokens as "
                  f"without speculation: {metrics['same_tokens_as_plain']} (per prompt, tokens "
                  f"before the first difference: {metrics['tokens_as_plain']} of "
                  f"{[len(e) for e in expected[name]]})", flush=True)
    for name in tpot:
        for k in KS:
            engine.proposer.k = k
            tpot[name][f"ngram k={k}"] = batch1_tpot_ms(spec, WORKLOADS[name], params)
        results[f"{name} batch-1 TPOT ms"] = tpot[name]
        print(f"{name:8s} batch-1 TPOT ms: plain {tpot[name]['plain']:.2f}, " + ", ".join(
            f"n-gram k={k} {tpot[name][f'ngram k={k}']:.2f} "
            f"({tpot[name]['plain'] / tpot[name][f'ngram k={k}']:.2f}x)" for k in KS),
            flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
