"""Two engines on one GPU, each at gpu_memory_utilization 0.4: both start, both generate, and
each process holds about 0.4 of the device (nvidia-smi), not jax's default share or more.

    python benchmarks/two_engines.py --out DIR [--model llama-3.1-8b] [--utilization 0.4]

Each engine is its own process on GPU 0 (a dummy-weight preset, greedy). Both start, generate
and report; once both are up, nvidia-smi is read; then both generate again (side by side) and
exit. Writes DIR/two_engines.json and each engine's log (DIR/engine_A.log, _B), prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30


def child(args) -> None:
    """One engine: start, generate, report, wait for the parent's word, generate again."""
    from jaxllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=8, max_num_batched_tokens=512,
              gpu_memory_utilization=args.utilization)
    started = time.perf_counter() - start
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    _report(llm, {"event": "ready", "start_s": round(started, 1)})
    sys.stdin.readline()  # both engines up: the parent has read nvidia-smi
    llm.reset_prefix_cache()  # the same computation as the first run: the same greedy tokens
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    _report(llm, {"event": "done", "same_tokens": again == first})


def _report(llm, row: dict) -> None:
    import jax

    from jaxllm.worker.device_memory import FRACTION_ENV

    stats = jax.devices()[0].memory_stats() or {}
    row.update(pid=os.getpid(), pool_share=os.environ.get(FRACTION_ENV),
               pool_gib=stats.get("bytes_limit", 0) / GIB,
               in_use_gib=stats.get("bytes_in_use", 0) / GIB,
               peak_gib=stats.get("peak_bytes_in_use", 0) / GIB,
               num_blocks=llm.llm_engine.num_blocks)
    print("ROW " + json.dumps(row), flush=True)


def nvidia_smi() -> dict:
    """pid -> MiB used on the GPU, and the device's total and used MiB."""
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True)
    device = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.total,memory.used",
                             "--format=csv,noheader,nounits"], capture_output=True, text=True)
    per_pid = {}
    for line in apps.stdout.strip().splitlines():
        pid, used = (x.strip() for x in line.split(","))
        per_pid[int(pid)] = int(used)
    total, used = (int(x) for x in device.stdout.strip().split(","))
    return {"per_pid_mib": per_pid, "total_mib": total, "used_mib": used}


def _read_row(proc, name: str, timeout_s: float) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {name} exited (rc {proc.wait()}) before reporting")
        if line.startswith("ROW "):
            return json.loads(line[4:])
        print(f"  [{name}] {line.rstrip()}", flush=True)
    raise TimeoutError(f"engine {name}: no report within {timeout_s} s")


def parent(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", PYTHONPATH=ROOT)
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)  # the engine's knob must decide
    cmd = [sys.executable, __file__, "--child", "--model", args.model,
           "--utilization", str(args.utilization)]
    procs = {}
    for name in ("A", "B"):  # B starts while A holds its share
        log = open(os.path.join(args.out, f"engine_{name}.log"), "w")  # noqa: SIM115
        procs[name] = subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=log, text=True)
    result = {"utilization": args.utilization, "model": args.model, "engines": {}}
    try:
        for name, proc in procs.items():
            result["engines"][name] = {"ready": _read_row(proc, name, args.timeout)}
        result["nvidia_smi"] = nvidia_smi()
        for proc in procs.values():
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for name, proc in procs.items():
            result["engines"][name]["done"] = _read_row(proc, name, args.timeout)
            result["engines"][name]["rc"] = proc.wait(timeout=120)
    except (RuntimeError, TimeoutError) as exc:
        result["error"] = str(exc)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    ok = _summarise(result)
    with open(os.path.join(args.out, "two_engines.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0 if ok else 1


def _summarise(result: dict) -> bool:
    smi = result.get("nvidia_smi", {"per_pid_mib": {}, "total_mib": 0})
    bound_mib = result["utilization"] * smi["total_mib"]
    ok = "error" not in result and len(result["engines"]) == 2
    print("| engine | start s | pool share | jax pool GiB | jax in use GiB | nvidia-smi GiB | "
          "KV blocks | second run same tokens | rc |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rows in result["engines"].items():
        ready, done = rows.get("ready", {}), rows.get("done", {})
        used = smi["per_pid_mib"].get(ready.get("pid"))
        # the CUDA context and library handles lie outside jax's pool: allow 2 GiB over
        ok &= (done.get("same_tokens") is True and rows.get("rc") == 0 and used is not None
               and used <= bound_mib + 2048)
        print(f"| {name} | {ready.get('start_s')} | {ready.get('pool_share')} | "
              f"{ready.get('pool_gib', 0):.1f} | {ready.get('in_use_gib', 0):.1f} | "
              f"{'-' if used is None else f'{used / 1024:.1f}'} | {ready.get('num_blocks')} | "
              f"{done.get('same_tokens')} | {rows.get('rc')} |")
    print(f"device: {smi.get('used_mib', 0) / 1024:.1f} of {smi['total_mib'] / 1024:.1f} GiB used;"
          f" bound per engine {bound_mib / 1024:.1f} GiB (+2 GiB outside the pool); "
          f"{'PASS' if ok else 'FAIL'} {result.get('error', '')}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="two_engines_out")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--utilization", type=float, default=0.4)
    parser.add_argument("--timeout", type=float, default=420.0, help="per engine event, seconds")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
