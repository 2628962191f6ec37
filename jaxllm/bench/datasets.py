"""Benchmark prompts: vLLM's random dataset (token ids, optionally behind one shared prefix), its
prefix_repetition dataset, ShareGPT-format JSON files, and multi-turn chats (each turn resends
the conversation so far: its SampleRequest holds only the turn's new tokens)."""

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
    # multi_turn: the conversation this turn continues (its turns come in order), else None
    conversation: int | None = None


DATASETS = ("random", "sharegpt", "prefix_repetition", "multi_turn")


def add_dataset_args(parser: argparse.ArgumentParser, input_len: int = 1024,
                     output_len: int = 128, num_prompts: int = 1000, seed_flag: bool = True) -> None:
    """seed_flag=False where the engine's own --seed is on the same parser."""
    parser.add_argument("--dataset-name", default=None, choices=DATASETS,
                        help="default: sharegpt with --dataset-path, else random")
    parser.add_argument("--dataset-path", default=None, help="a ShareGPT-format JSON file")
    parser.add_argument("--random-prefix-len", type=int, default=0,
                        help="random: tokens of one prefix shared by every prompt, before its "
                             "--input-len own tokens")
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)
    parser.add_argument("--multi-turn-num-turns", type=int, default=4,
                        help="multi_turn: turns per conversation (--num-prompts counts turns)")
    parser.add_argument("--multi-turn-turn-len", type=int, default=128,
                        help="multi_turn: new user tokens per turn (the first turn also has "
                             "--random-prefix-len tokens of a shared system prompt)")
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
                    range_ratio: float = 0.0, seed: int = 0,
                    prefix_len: int = 0) -> list[SampleRequest]:
    """Uniform random token ids; lengths uniform in [len * (1 - r), len * (1 + r)]; with
    prefix_len, one random prefix of that many tokens leads every prompt (vLLM's
    --random-prefix-len)."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}.")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"input_len and output_len must be at least 1, got {input_len} and "
                         f"{output_len}.")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}.")
    if prefix_len < 0:
        raise ValueError(f"random_prefix_len must be at least 0, got {prefix_len}.")
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, prefix_len).tolist()
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    return [SampleRequest(prefix + rng.integers(0, vocab_size, n).tolist(), prefix_len + int(n),
                          int(m)) for n, m in zip(input_lens, output_lens)]


def prefix_repetition_requests(num_prompts: int, prefix_len: int, suffix_len: int,
                               num_prefixes: int, output_len: int, vocab_size: int,
                               seed: int = 0) -> list[SampleRequest]:
    """vLLM's prefix_repetition: num_prefixes random prefixes, each leading an equal share of
    the prompts with random suffixes of its own, in shuffled order."""
    if not 1 <= num_prefixes <= num_prompts:
        raise ValueError(f"prefix_repetition_num_prefixes must be in [1, num_prompts="
                         f"{num_prompts}], got {num_prefixes}.")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1 or output_len < 1:
        raise ValueError("prefix_repetition needs prefix_len + suffix_len >= 1 and output_len "
                         f">= 1, got {prefix_len}, {suffix_len} and {output_len}.")
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num_prefixes):
        prefix = rng.integers(0, vocab_size, prefix_len).tolist()
        count = num_prompts // num_prefixes + (i < num_prompts % num_prefixes)
        requests += [SampleRequest(prefix + rng.integers(0, vocab_size, suffix_len).tolist(),
                                   prefix_len + suffix_len, output_len) for _ in range(count)]
    return [requests[i] for i in rng.permutation(len(requests))]


def multi_turn_requests(num_prompts: int, num_turns: int, turn_len: int, output_len: int,
                        vocab_size: int, system_len: int = 0,
                        seed: int = 0) -> list[SampleRequest]:
    """num_prompts // num_turns conversations of num_turns turns, conversation by conversation;
    each turn holds only its new user tokens (the first also a shared system prompt), and its
    real prompt is the conversation so far, outputs included (see conversation_prompts)."""
    if num_turns < 1 or turn_len < 1 or output_len < 1 or num_prompts < num_turns:
        raise ValueError(f"multi_turn needs num_turns, turn_len, output_len >= 1 and "
                         f"num_prompts >= num_turns, got {num_turns}, {turn_len}, {output_len} "
                         f"and {num_prompts}.")
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, system_len).tolist()
    requests = []
    for conversation in range(num_prompts // num_turns):
        for turn in range(num_turns):
            tokens = (system if turn == 0 else []) + rng.integers(0, vocab_size,
                                                                   turn_len).tolist()
            requests.append(SampleRequest(tokens, len(tokens), output_len, conversation))
    return requests


def conversations(requests: list[SampleRequest]) -> list[list[SampleRequest]]:
    """Multi-turn requests grouped into their conversations, turns in order."""
    turns: dict[int, list[SampleRequest]] = {}
    for request in requests:
        turns.setdefault(request.conversation, []).append(request)
    return list(turns.values())


class ConversationHistory:
    """Multi-turn prompts: each turn's prompt is its conversation so far (earlier prompts and
    their outputs) followed by the turn's own tokens."""

    def __init__(self) -> None:
        self.history: dict[int, list[int]] = {}

    def prompt(self, request: SampleRequest) -> list[int]:
        return self.history.get(request.conversation, []) + list(request.prompt)

    def record(self, request: SampleRequest, prompt: list[int], output_ids: list[int]) -> None:
        self.history[request.conversation] = prompt + list(output_ids)


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
    name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    if name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path.")
        return sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.output_len,
                                 args.seed)
    if name == "prefix_repetition":
        return prefix_repetition_requests(
            args.num_prompts, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len, vocab_size, args.seed)
    output_len = args.random_output_len if args.output_len is None else args.output_len
    if name == "multi_turn":
        return multi_turn_requests(args.num_prompts, args.multi_turn_num_turns,
                                   args.multi_turn_turn_len, output_len, vocab_size,
                                   args.random_prefix_len, args.seed)
    return random_requests(args.num_prompts, args.input_len, output_len, vocab_size,
                           args.range_ratio, args.seed, args.random_prefix_len)
