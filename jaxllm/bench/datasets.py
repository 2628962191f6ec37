"""Benchmark prompts: vLLM's random dataset (token ids) and ShareGPT-format JSON files."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

# vLLM's ShareGPT filter: drop pairs too short to time or too long for a 2k context.
_MIN_LEN, _MAX_PROMPT_LEN, _MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass
class SampleRequest:
    prompt: list[int] | str  # token ids (random) or text (ShareGPT)
    prompt_len: int
    expected_output_len: int


def add_dataset_args(parser: argparse.ArgumentParser, input_len: int = 1024,
                     output_len: int = 128, num_prompts: int = 1000, seed_flag: bool = True) -> None:
    """seed_flag=False where the engine's own --seed is on the same parser."""
    parser.add_argument("--dataset-path", default=None,
                        help="a ShareGPT-format JSON file; default: the random dataset")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=input_len)
    parser.add_argument("--output-len", type=int, default=None,
                        help=f"output tokens per request (random dataset default {output_len}; "
                             f"with --dataset-path each reply's own length unless given)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    if seed_flag:
        parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(random_output_len=output_len)


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Uniform random token ids; lengths uniform in [len * (1 - r), len * (1 + r)]."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}.")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be at least 1, got {input_len} and "
                         f"{output_len}.")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}.")
    rng = np.random.default_rng(seed)
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    return [SampleRequest(rng.integers(0, vocab_size, n).tolist(), int(n), int(m))
            for n, m in zip(input_lens, output_lens)]


def _lengths(rng: np.random.Generator, length: int, range_ratio: float, num: int) -> np.ndarray:
    low = max(int(length * (1 - range_ratio)), 1)
    high = max(int(length * (1 + range_ratio)), low)
    return rng.integers(low, high + 1, num)


def sharegpt_requests(path: str, num_prompts: int, tokenizer, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """First human turn as the prompt, the reply's token count as the output length."""
    if tokenizer is None:
        raise ValueError("--dataset-path needs a tokenizer: the model has none (a dummy preset?).")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [d["conversations"] for d in data if len(d.get("conversations", ())) >= 2]
    order = np.random.default_rng(seed).permutation(len(pairs))
    requests = []
    for i in order:
        prompt, reply = pairs[i][0]["value"], pairs[i][1]["value"]
        prompt_len = len(tokenizer.encode(prompt))
        reply_len = output_len or len(tokenizer.encode(reply))
        if output_len is None and not _valid_pair(prompt_len, reply_len):
            continue
        requests.append(SampleRequest(prompt, prompt_len, reply_len))
        if len(requests) == num_prompts:
            return requests
    raise ValueError(f"{path} holds {len(requests)} usable conversations; {num_prompts} were "
                     f"asked for (--num-prompts).")


def _valid_pair(prompt_len: int, output_len: int) -> bool:
    return (prompt_len >= _MIN_LEN and output_len >= _MIN_LEN and prompt_len <= _MAX_PROMPT_LEN
            and prompt_len + output_len <= _MAX_TOTAL_LEN)


def sample_requests(args: argparse.Namespace, tokenizer, vocab_size: int) -> list[SampleRequest]:
    """The requests add_dataset_args' flags describe."""
    if args.dataset_path:
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.output_len,
                                 args.seed)
    output_len = args.random_output_len if args.output_len is None else args.output_len
    return random_requests(args.num_prompts, args.input_len, output_len, vocab_size,
                           args.range_ratio, args.seed)
