"""The pooling runner: one jitted forward + pooler per step over a padded [S, L] batch.

Every (rows, length) bucket of the grid (batch_shapes) is compiled at warm-up, so nothing
compiles while serving. A step's inputs are built in numpy as one int32 array (one host-to-device
transfer: each costs about a tenth of a short batch's host time) and its output fetched in one
device-to-host transfer; a request's row is then finished (models/pooler.py says what it holds).
With LoRA, params["lora"] holds the adapters' device slots and a step's last input is each row's
slot: adapters are moved into slots before the step launches, by one program for every slot,
so switching adapters compiles nothing.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable

import jax
import numpy as np

from jaxllm.core.pooling_scheduler import PoolingRequest, bucket
from jaxllm.worker.lora_slots import LoRASlots
from jaxllm.worker.model_runner import token_buckets

logger = logging.getLogger(__name__)


def batch_shapes(max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int) -> dict[int, list[int]]:
    """Length bucket L (powers of two from 16, closed by max_model_len) -> its row-count buckets:
    powers of 4, closed by the most rows of length L the token budget holds (at least one)."""
    shapes = {}
    for length in token_buckets(max_model_len):
        most = max(1, min(max_num_seqs, max_num_batched_tokens // length))
        rows, size = [], 1
        while size < most:
            rows.append(size)
            size *= 4
        shapes[length] = rows + [most]
    return shapes


class PoolingRunner:
    def __init__(self, encode_fn: Callable, params, shapes: dict[int, list[int]],
                 per_token: bool = False, lora_slots: LoRASlots | None = None) -> None:
        """encode_fn(params, token_ids [S, L], token_type_ids [S, L], lengths [S] [, lora_slots
        [S] with LoRA]) -> [S, D] float32 (per_token: [S, L, D], of which a request gets its own
        tokens)."""
        self.lora = lora_slots
        self.params = params if lora_slots is None else lora_slots.with_stacks(params)
        self.shapes = shapes
        self.lengths = sorted(shapes)
        self.per_token = per_token
        self._encode = encode_fn
        self._jit = jax.jit(self._unpacked)
        self._compiled: dict[tuple[int, int], Callable] = {}

    def _unpacked(self, params, rows: jax.Array) -> jax.Array:
        """rows [S, 2L + 1 (+ 1 with LoRA)] int32: token ids, token types, length (, slot)."""
        length = (rows.shape[1] - 1 - (self.lora is not None)) // 2
        slots = (rows[:, -1],) if self.lora is not None else ()
        return self._encode(params, rows[:, :length], rows[:, length:2 * length],
                            rows[:, 2 * length], *slots)

    def bucket_for(self, num_seqs: int, max_len: int) -> tuple[int, int]:
        length = bucket(max_len, self.lengths)
        return bucket(num_seqs, self.shapes[length]), length

    def _inputs(self, requests: list[PoolingRequest], num_rows: int, length: int,
                busy: set[int]) -> np.ndarray:
        """The step's rows, as _unpacked reads them; padding rows: one token (no empty
        softmax), slot 0. With LoRA, the rows' adapters are moved into slots here."""
        rows = np.zeros((num_rows, 2 * length + 1 + (self.lora is not None)), np.int32)
        rows[:, 2 * length] = 1
        for row, request in enumerate(requests):
            ids = request.prompt_token_ids
            rows[row, :len(ids)] = ids
            rows[row, 2 * length] = len(ids)
            start = request.pooling_params.token_type_start
            if start is not None:
                rows[row, length + start:length + len(ids)] = 1
        if self.lora is not None:
            rows[:, -1] = self._lora_rows(requests, num_rows, busy)
        return rows

    def launch(self, requests: list[PoolingRequest], busy: set[int] = frozenset()) -> jax.Array:
        """Dispatches the step; returns its output on device without waiting for it. busy: the
        LoRA slots of the step in flight, which keep their adapters."""
        shape = self.bucket_for(len(requests), max(len(r.prompt_token_ids) for r in requests))
        rows = self._inputs(requests, *shape, set(busy))
        return self._compiled.get(shape, self._jit)(self.params, rows)

    def _lora_rows(self, requests: list[PoolingRequest], num_rows: int,
                   busy: set[int]) -> np.ndarray:
        """Each row's adapter slot (0: the base model, as padding rows), the adapters moved
        into slots as needed (the scheduler keeps them within max_loras with busy's)."""
        rows = np.zeros(num_rows, np.int32)
        for row, request in enumerate(requests):
            request.lora_slot = self.lora.slot_for(request.lora_request, busy)
            busy.add(request.lora_slot)
            rows[row] = request.lora_slot
        self.params = self.lora.with_stacks(self.params)
        return rows

    def collect(self, requests: list[PoolingRequest], launched: jax.Array):
        """Waits for a launched step; each request's pooled output (float32), in order: the
        rows of one [requests, D] array, or (per_token) a list of [its tokens, D] arrays."""
        out = np.asarray(jax.device_get(launched))
        if self.per_token:
            return [out[i, :len(r.prompt_token_ids)] for i, r in enumerate(requests)]
        return out[:len(requests)]

    def warmup(self, progress: Callable[[str], None] = logger.info) -> None:
        """Compiles every bucket's program (in a thread pool: XLA compiles without the GIL)."""
        start = time.perf_counter()
        if self.lora is not None:
            self.lora.warmup()
        shapes = [(rows, length) for length in self.lengths for rows in self.shapes[length]]
        with ThreadPoolExecutor(max(1, min(len(shapes), os.cpu_count() or 1))) as pool:
            futures = {pool.submit(self._jit.lower(self.params,
                                                   self._inputs([], *shape, set())).compile): shape
                       for shape in shapes}
            for n, future in enumerate(as_completed(futures), 1):
                self._compiled[futures[future]] = future.result()
                progress(f"warm-up: compiled {n}/{len(shapes)} pooling programs "
                         f"({futures[future][0]} x {futures[future][1]} tokens), "
                         f"{time.perf_counter() - start:.1f}s")
