"""One GPU call: the batched multi-LoRA kernels (pallas_kernels/lora.py) on an 8B-like projection.

    python benchmarks/lora_kernels_gpu.py --out DIR [--sweep]   # one H200, a minute (sweep: a few)
    python benchmarks/lora_kernels_gpu.py --out DIR --cpu       # tiny shapes in interpret mode

H 4096 -> N 6144, rank 16, 16 adapters + slot 0 (no adapter), bf16; T tokens (decode 1, 8, 64;
a 512-token prefill chunk) with slot ids drawn uniformly from [0, 17). Per T, microseconds per
call of the GPU kernels each variant runs, read from a jax.profiler trace (the sum of the kernel
durations over chained calls, divided by the call count: wall-clock timings carry tens of
microseconds of dispatch, which hides kernels of a few), each kernel's share kept too:
- lora: lora_add, i.e. lora_shrink + lora_expand (and the XLA ops around them, the sum of
  shrink's partial products among them), the slot sort included (slot
  ids go through the chain, so each call sorts; in a step one sort serves every layer's calls:
  sort_us alone);
- reference: lora_shrink_reference + lora_expand_reference (XLA, fp32, every adapter);
- gemm: the base projection x [T, H] @ W [H, N] itself (three copies of W rotated, so its
  weights come from HBM as each layer's do), the cost the LoRA adds to;
and the floor: the bytes the kernels must move (x, the adapters the tokens use, base read and
written) over the measured copy bandwidth. Adapters rotate among 11 copies (more than L2).
Correctness on the GPU first (interpret mode hides races and stray stores): per T, random and
all-one-adapter slot ids with slot 0's weights NaN (never to be read), and one shape off the
tiles (R 8), both paths against the fp32 references (max_rel_err). `--sweep` adds tile variants
of each kernel. DIR gets lora_kernels.json; a table prints last. On the CPU no trace holds GPU
kernels: the times are NaN there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from profile_decode import kernel_summary

from pallas_kernels import lora
from pallas_kernels.ceilings import measure_ceilings

SIZES = {  # GPU, then --cpu
    "gpu": dict(tokens=[1, 8, 64, 512], hidden=4096, n_dim=6144, rank=16, slots=17,
                adapter_copies=11, weight_copies=3),
    "cpu": dict(tokens=[12], hidden=128, n_dim=96, rank=16, slots=5, adapter_copies=2,
                weight_copies=1),
}
ODD_SHAPE = {"gpu": (37, 4000, 6000, 8, 5), "cpu": (5, 100, 72, 8, 3)}  # T, H, N, R, S
SHRINK_SWEEP = ([dict(block_k=bk, num_warps=w) for bk in (64, 128) for w in (2, 4)]
                + [dict(num_splits=s) for s in (1, 4, 16)])
EXPAND_SWEEP = [dict(block_n=bn, num_warps=w) for bn in (64, 128, 256) for w in (4, 8)]
CHAIN, RUNS = 8, 2  # calls chained in one jit, traced runs of the chain


def inputs(num_tokens, sizes, rng):
    """x, base, slot ids, copies of (a, b) with slot 0 zero, copies of W; all bf16."""
    hidden, n_dim, rank, slots = (sizes[k] for k in ("hidden", "n_dim", "rank", "slots"))
    bf16 = lambda v: jnp.asarray(v, jnp.bfloat16)

    def adapters():
        a = rng.standard_normal((slots, hidden, rank)) / np.sqrt(hidden)
        b = rng.standard_normal((slots, rank, n_dim)) / np.sqrt(rank)
        a[0], b[0] = 0, 0
        return bf16(a), bf16(b)
    x = bf16(rng.standard_normal((num_tokens, hidden)))
    base = bf16(rng.standard_normal((num_tokens, n_dim)))
    slot_ids = jnp.asarray(rng.integers(0, slots, num_tokens), jnp.int32)
    weights = [bf16(rng.standard_normal((hidden, n_dim)) / np.sqrt(hidden))
               for _ in range(sizes["weight_copies"])]
    return x, base, slot_ids, [adapters() for _ in range(sizes["adapter_copies"])], weights


def two_kernels(shrink, expand):
    """(base, x, a, b, slot ids) -> base + LoRA, through shrink then expand."""
    return lambda base, x, a, b, slot_ids: expand(base, shrink(x, a, slot_ids), b, slot_ids)


def lora_call(apply):
    """A chainable call: (x, base, slot ids) -> (x, apply(base, x, a, b, slot ids), slot ids),
    adapters rotated."""
    def call(carry, i, copies):
        x, base, slot_ids = carry
        a, b = copies[i % len(copies)]
        return x, apply(base, x, a, b, slot_ids), slot_ids
    return call


def gemm_call(carry, i, weights):
    x, _, slot_ids = carry
    return x, x @ weights[i % len(weights)], slot_ids


def sort_call(num_slots):
    """The wrapper's slot sort alone, chainable: its sorted slot ids are the next call's."""
    def call(carry, i):
        x, base, slot_ids = carry
        item_slot, _, _, order = lora._sort_by_slot(
            slot_ids, num_slots, lora._block_m(slot_ids.shape[0], num_slots))
        return x, base, jnp.where(item_slot[0] < -1, 0, slot_ids[order])  # never 0: kept live
    return call


def trace_us(call, carry, *args) -> dict:
    """{"us": GPU kernel microseconds per call, "kernels": [(kernel, us per call)]}, from a
    jax.profiler trace of RUNS runs of CHAIN calls in one jit, each call's output the next one's
    input (as ceilings.time_chain chains them: nothing hoisted or merged); us is NaN when the
    trace holds no GPU."""
    def run(carry, *args):
        for i in range(CHAIN):
            carry = jax.lax.optimization_barrier(call(carry, i, *args))
        return carry
    fn = jax.jit(run)
    carry = jax.block_until_ready(fn(carry, *args))  # compiled and warm before the trace
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(RUNS):
                carry = fn(carry, *args)
            jax.block_until_ready(carry)
        summary = kernel_summary(trace_dir, CHAIN * RUNS, top=1000)
    kernels = [v for k, v in summary.items() if "GPU" in k]
    return {"us": sum(us for _, us in kernels[0]) if kernels else float("nan"),
            "kernels": kernels[0] if kernels else []}


def floor_bytes(num_tokens, slot_ids, sizes) -> int:
    """x read, each used adapter's A and B read once, base read and written (2-byte values)."""
    used = len(set(np.asarray(slot_ids).tolist()) - {0})
    h, n, r = sizes["hidden"], sizes["n_dim"], sizes["rank"]
    return 2 * (num_tokens * h + used * (h * r + r * n) + 2 * num_tokens * n)


def max_rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


reference = lora.lora_add_reference


def kernel_paths(interpret) -> dict:
    """The kernels' way to add a LoRA: (base, x, a, b, slot ids) -> base + LoRA."""
    return {"lora": functools.partial(lora.lora_add, interpret=interpret)}


def check(x, base, slot_ids, a, b, interpret) -> float:
    """The kernels' largest relative error against the references, slot 0's weights NaN for
    the kernels (never read) and zero for the references; inf when the output is not finite.
    On the GPU this is what interpret mode cannot show: races, stray stores."""
    nan_a, nan_b = a.at[0].set(jnp.nan), b.at[0].set(jnp.nan)
    want = reference(base, x, a, b, slot_ids)
    errors = []
    for apply in kernel_paths(interpret).values():
        got = np.asarray(apply(base, x, nan_a, nan_b, slot_ids), np.float32)
        errors.append(max_rel_err(got, want) if np.isfinite(got).all() else float("inf"))
    return max(errors)


def odd_shape_check(shape, interpret) -> float:
    """check() where T, H, N are off the tiles and R = 8."""
    num_tokens, hidden, n_dim, rank, slots = shape
    sizes = dict(hidden=hidden, n_dim=n_dim, rank=rank, slots=slots, adapter_copies=1,
                 weight_copies=0)
    x, base, slot_ids, [(a, b)], _ = inputs(num_tokens, sizes, np.random.default_rng(1))
    return check(x, base, slot_ids, a, b, interpret)


def measure(num_tokens, sizes, copy_bytes_per_s, interpret, sweep) -> dict:
    x, base, slot_ids, copies, weights = inputs(num_tokens, sizes, np.random.default_rng(0))
    carry = (x, base, slot_ids)
    paths = kernel_paths(interpret)
    one_slot = jnp.full_like(slot_ids, sizes["slots"] - 1)  # every token one adapter
    timed = {**{name: trace_us(lora_call(apply), carry, copies) for name, apply in paths.items()},
             "reference": trace_us(lora_call(reference), carry, copies),
             "gemm": trace_us(gemm_call, carry, weights),
             "sort": trace_us(sort_call(sizes["slots"]), carry)}
    row = {"tokens": num_tokens,
           "max_rel_err": max(check(x, base, ids, *copies[0], interpret)
                              for ids in (slot_ids, one_slot)),
           "floor_us": floor_bytes(num_tokens, slot_ids, sizes) / copy_bytes_per_s * 1e6,
           **{f"{name}_us": t["us"] for name, t in timed.items()},
           "kernels": {name: t["kernels"] for name, t in timed.items()}}
    row["pct_floor"] = 100 * row["floor_us"] / row["lora_us"]
    if sweep:
        shrink, expand = (functools.partial(k, interpret=interpret)
                          for k in (lora._shrink, lora._expand))
        variants = ([("shrink", t, two_kernels(functools.partial(shrink, **t), expand))
                     for t in SHRINK_SWEEP]
                    + [("expand", t, two_kernels(shrink, functools.partial(expand, **t)))
                       for t in EXPAND_SWEEP])
        row["sweep"] = [sweep_row(kind, tiles, lora_call(apply), carry, copies)
                        for kind, tiles, apply in variants]
    return row


def sweep_row(kind, tiles, call, carry, copies) -> dict:
    """One tile variant: its kernels' time, or the error a tile Triton cannot fit raises."""
    try:
        return {"kernel": kind, "tiles": tiles, "us": trace_us(call, carry, copies)["us"]}
    except Exception as e:  # a failing variant is a row, not the end of the run
        return {"kernel": kind, "tiles": tiles, "error": f"{type(e).__name__}: {str(e)[:200]}"}


def table(rows) -> str:
    lines = ["| T | lora us | sort us | reference us | gemm us | floor us | % floor | "
             "lora / gemm | max rel err |", "|" + " --- |" * 9]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['lora_us']:.1f} | {r['sort_us']:.1f} | "
                     f"{r['reference_us']:.1f} | {r['gemm_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['pct_floor']:.0f} | {r['lora_us'] / r['gemm_us']:.2f} | "
                     f"{r['max_rel_err']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes, kernels interpreted")
    parser.add_argument("--sweep", action="store_true", help="also time tile variants")
    parser.add_argument("--tokens", type=int, nargs="+", help="override the T values")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sizes = dict(SIZES["cpu" if args.cpu else "gpu"])
    sizes["tokens"] = args.tokens or sizes["tokens"]
    ceilings = (measure_ceilings("bfloat16", copy_bytes=1 << 20, matmul_n=128, reps=3)
                if args.cpu else measure_ceilings("bfloat16"))
    result = {"device": ceilings.device, "jax": jax.__version__, "sizes": sizes,
              "ceilings": ceilings.as_dict(), "rows": []}
    result["odd_shape_rel_err"] = odd_shape_check(ODD_SHAPE["cpu" if args.cpu else "gpu"],
                                                  args.cpu)
    print(f"odd shape {ODD_SHAPE['cpu' if args.cpu else 'gpu']}: max rel err "
          f"{result['odd_shape_rel_err']:.1e}", flush=True)
    for num_tokens in sizes["tokens"]:
        row = measure(num_tokens, sizes, ceilings.hbm_bytes_per_s, args.cpu, args.sweep)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "lora_kernels.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{result['device']}, copy {ceilings.hbm_bytes_per_s / 1e9:.0f} GB/s")
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
