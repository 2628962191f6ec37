"""Per-step sampling parameters as fixed-shape arrays, built on the host from SamplingParams.

Every per-request knob is an array row, never a static argument, so one compiled step serves any
mix of temperatures, top-k/p, penalties and seeds. Scalar flags let the jitted sampler skip
whole stages (the top-k/top-p sort, penalties, logprobs) with lax.cond when no row uses them,
and tell the runner which of its cond-free programs a batch needs (sampler.sample's stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxllm.sampling_params import SamplingParams

# Stop ids (EOS + stop_token_ids) that min_tokens can mask per request; the array has this width.
MAX_MIN_TOKENS_STOP_IDS = 8


@jax.tree_util.register_dataclass
@dataclass
class SamplingMetadata:
    temperature: jax.Array  # [S] f32, 0 = greedy
    top_k: jax.Array  # [S] i32, 0 = off
    top_p: jax.Array  # [S] f32, 1 = off
    min_p: jax.Array  # [S] f32, 0 = off
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    seeds: jax.Array  # [S] uint32
    output_index: jax.Array  # [S] i32: output tokens generated so far (folded into the key)
    min_tokens_stop_ids: jax.Array  # [S, K] i32: ids banned below min_tokens, -1 padded
    any_top_k_top_p: jax.Array  # [] bool
    any_penalties: jax.Array  # [] bool
    any_logprobs: jax.Array  # [] bool


def min_tokens_stop_ids(params: SamplingParams) -> list[int]:
    """The ids vLLM's min-tokens processor bans: stop_token_ids plus EOS unless ignore_eos
    (the engine puts EOS into all_stop_token_ids only when ignore_eos is off)."""
    return sorted(set(params.stop_token_ids) | set(params.all_stop_token_ids))


def check_min_tokens_stop_ids(params: SamplingParams) -> None:
    """Raises unless the sampler can ban all of the request's stop ids below min_tokens; the
    engine calls it when a request arrives (after filling all_stop_token_ids)."""
    if params.min_tokens and len(min_tokens_stop_ids(params)) > MAX_MIN_TOKENS_STOP_IDS:
        raise ValueError(f"min_tokens supports at most {MAX_MIN_TOKENS_STOP_IDS} stop token ids "
                         f"(EOS included), got {len(min_tokens_stop_ids(params))}.")


def build_sampling_metadata(params_list: Sequence[SamplingParams | None],
                            output_indices: Sequence[int], seeds: Sequence[int],
                            num_seqs_padded: int) -> SamplingMetadata:
    """Numpy arrays for one step; row i is params_list[i], rows past it (and None) are greedy
    padding. seeds[i] is the request's seed (the caller draws one for unseeded requests) and is
    taken modulo 2**32. Runs every step, so it does one list-to-array conversion."""
    num_seqs = len(params_list)
    if num_seqs > num_seqs_padded:
        raise ValueError(f"{num_seqs} sequences exceed the padded batch of {num_seqs_padded}.")
    params = [p if p is not None else _PADDING for p in params_list]
    # One host conversion for all float columns (top_k is exact in float32 below 2**24).
    table = np.zeros((num_seqs_padded, 7), np.float32)
    table[:, 2] = table[:, 6] = 1.0  # padding: top_p and repetition_penalty off
    if params:
        table[:num_seqs] = [(0.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p,
                             p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
                            for p in params]
    temperature, top_k, top_p, min_p, presence, frequency, repetition = table.T
    seeds_arr = np.zeros(num_seqs_padded, np.uint32)
    output_index = np.zeros(num_seqs_padded, np.int32)
    stop_ids = np.full((num_seqs_padded, MAX_MIN_TOKENS_STOP_IDS), -1, np.int32)
    any_logprobs = False
    for i, p in enumerate(params_list):
        if p is None:
            continue
        seeds_arr[i], output_index[i] = seeds[i] % (1 << 32), output_indices[i]
        any_logprobs |= p.logprobs is not None
        if output_indices[i] < p.min_tokens:
            check_min_tokens_stop_ids(p)
            ids = min_tokens_stop_ids(p)
            stop_ids[i, :len(ids)] = ids
    return SamplingMetadata(
        temperature=temperature.copy(), top_k=top_k.astype(np.int32), top_p=top_p.copy(),
        min_p=min_p.copy(), presence_penalty=presence.copy(), frequency_penalty=frequency.copy(),
        repetition_penalty=repetition.copy(), seeds=seeds_arr, output_index=output_index,
        min_tokens_stop_ids=stop_ids,
        # Top-k/top-p/min-p keep the argmax, so only random rows need the sort.
        any_top_k_top_p=np.array(bool(((temperature > 0) & ((top_k > 0) | (top_p < 1))).any())),
        any_penalties=np.array(bool((presence != 0).any() or (frequency != 0).any()
                                    or (repetition != 1).any())),
        any_logprobs=np.array(any_logprobs))


_PADDING = SamplingParams(temperature=0.0)  # what a None row samples with
