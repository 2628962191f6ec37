"""Host overhead of one decode step: schedule(), the runner's host side (its request states and
build_step_batch()) and update_from_output().

256 running sequences decode one token each per step (no device work). The target for the
whole host side is under 1 ms per step.

    python benchmarks/host_overhead.py [--num-seqs 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from jaxllm.config import CacheConfig, SchedulerConfig
from jaxllm.core.request import Request
from jaxllm.core.scheduler import Scheduler
from jaxllm.sampling_params import SamplingParams
from jaxllm.worker.batch import SeqChunk, build_step_batch
from jaxllm.worker.request_states import RequestStates


def make_decoding_scheduler(num_seqs: int, max_model_len: int, block_size: int) -> Scheduler:
    """A scheduler whose num_seqs requests have finished prefill and are decoding."""
    num_blocks = num_seqs * (max_model_len // block_size) + 1
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192,
                        max_model_len=max_model_len),
        CacheConfig(block_size=block_size), num_blocks)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=max_model_len // 2, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(32000) for _ in range(rng.randrange(16, max_model_len // 2))]
        scheduler.add_request(Request(f"req-{i}", prompt, params))
    return scheduler


def step(scheduler: Scheduler, states: RequestStates,
         rng: random.Random) -> tuple[float, float, float]:
    """One host step as the model runner does it; returns the seconds spent scheduling,
    building the batch (request states and block tables kept per row, as the runner keeps
    them), updating."""
    t0 = time.perf_counter()
    output = scheduler.schedule()
    t1 = time.perf_counter()
    chunks = states.apply(output)
    rows = np.fromiter((c.state.row for c in chunks), np.int32, len(chunks))
    num_seqs_padded = bucket(len(chunks))
    build_step_batch([SeqChunk(c.token_ids, c.start) for c in chunks],
                     bucket(output.total_num_scheduled_tokens), num_seqs_padded,
                     states.max_blocks_per_seq, scheduler.block_size,
                     block_tables=states.block_tables.gather(rows, num_seqs_padded))
    t2 = time.perf_counter()
    sampled = {c.state.request_id: [rng.randrange(32000)] for c in chunks if c.samples}
    for request_id, token_ids in sampled.items():
        states.record_sampled(request_id, token_ids)
    t3 = time.perf_counter()
    scheduler.update_from_output(output, sampled)
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t4 - t3


def bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    scheduler = make_decoding_scheduler(args.num_seqs, args.max_model_len, args.block_size)
    states = RequestStates(args.num_seqs, args.max_model_len // args.block_size)
    rng = random.Random(1)
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        step(scheduler, states, rng)  # prefill until every sequence decodes
    times = np.array([step(scheduler, states, rng) for _ in range(args.steps)]) * 1e6
    assert scheduler.num_running == args.num_seqs, "a sequence finished during the benchmark"
    columns = {"schedule": times[:, 0], "runner host side": times[:, 1],
               "update_from_output": times[:, 2], "total": times.sum(axis=1)}
    print(f"{args.num_seqs} decoding sequences, {args.steps} steps, microseconds per step:")
    for name, t in columns.items():
        print(f"  {name:>18}: mean {t.mean():8.1f}  p50 {np.percentile(t, 50):8.1f}  "
              f"p99 {np.percentile(t, 99):8.1f}")
    print(f"target < 1000 us per step: {'met' if columns['total'].mean() < 1000 else 'NOT met'}")


if __name__ == "__main__":
    main()
