"""The single-GPU benchmark suite in one call: jaxllm (ceilings, start-up, decode at 2k context vs
its floor, offline throughput vs its floor, throughput against concurrency) then HF transformers
on the same workloads, each in its own process (a crash or OOM in one leaves the other's
results), inside a time budget. Writes results.json, report.md and throughput_vs_concurrency.png
into --out and prints a summary table last.

    python benchmarks/gpu_suite.py --out $OUT              # Llama-3.1-8B shape, dummy weights
    python benchmarks/gpu_suite.py --out /tmp/s --smoke    # tiny config, small counts (CPU ok)
    python benchmarks/gpu_suite.py --out DIR --report-only # rebuild report and plot from DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

from suite_plan import DECODE_TARGETS, THROUGHPUT_TARGETS

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def run_worker(name: str, a: argparse.Namespace, deadline: float) -> dict:
    """Runs suite_<name>.py until `deadline` (epoch s); its items stop starting at deadline - 10."""
    scale = a.hf_scale if name == "hf" and a.hf_scale is not None else a.scale
    cmd = [sys.executable, os.path.join(HERE, f"suite_{name}.py"), "--out", a.out, "--scale",
           str(scale), "--deadline", str(deadline - 10)]
    cmd += ["--smoke"] * a.smoke + ["--long"] * a.long
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]))
    print(f"== {name} worker (budget {deadline - time.time():.0f}s)", flush=True)
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, env=env, cwd=REPO, timeout=max(deadline - time.time(), 1)).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    return {"returncode": rc, "wall_s": time.perf_counter() - start}


def _load(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# -- report ---------------------------------------------------------------------------------------
def _ok(item: dict | None) -> bool:
    return bool(item) and "error" not in item and "skipped" not in item


def _cell(item: dict | None, key: str, fmt: str = "{:,.0f}") -> str:
    if not item:
        return "not run"
    if "error" in item:
        return "error"
    if "skipped" in item:
        return "skipped"
    return fmt.format(item[key])


def summary_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(target, measured, goal, met) per issue target that ran."""
    jx, rows = results.get("jaxllm", {}), []
    for batch, goal in DECODE_TARGETS.items():
        item = jx.get(f"decode_b{batch}")
        if _ok(item):
            rows.append((f"decode batch {batch} @ {item['context_len']} ctx",
                         f"{item['median_step_ms']:.2f} ms/token ({100 * item['fraction_of_floor']:.0f}% of floor)",
                         f">= {100 * goal:.0f}% of floor",
                         "met" if item["fraction_of_floor"] >= goal else "NOT met"))
    for name, goal in THROUGHPUT_TARGETS.items():
        item = jx.get(f"throughput_{name}")
        if _ok(item):
            rows.append((f"offline {name} x {item['num_requests']}",
                         f"{item['output_tokens_per_second']:,.0f} out tok/s",
                         f">= {goal:,.0f}", "met" if item["output_tokens_per_second"] >= goal
                         else "NOT met"))
    start = jx.get("startup")
    if _ok(start):
        rows.append(("engine start-up (cold cache)", f"{start['startup_s']:.1f} s", "< 60 s",
                     "met" if start["startup_s"] < 60 else "NOT met"))
    warm = jx.get("startup_warm_cache")
    if _ok(warm):
        rows.append(("engine start-up (warm cache)", f"{warm['startup_s']:.1f} s", "< 20 s",
                     "met" if warm["startup_s"] < 20 else "NOT met"))
    return rows


def write_report(results: dict, out: str) -> str:
    jx, hf, meta = results.get("jaxllm", {}), results.get("hf", {}), results["meta"]
    env, hf_env = jx.get("env", {}), hf.get("env", {})
    lines = [f"### Single-GPU suite ({meta['date']})", "",
             f"Device: {env.get('device', '?')}; jax {env.get('jax', '?')}; torch "
             f"{hf_env.get('torch', '?')}, transformers {hf_env.get('transformers', '?')}; "
             f"commit {meta['commit']}; model {env.get('plan', {}).get('model', '?')} "
             f"(dummy weights, {env.get('plan', {}).get('dtype', '?')}); scale {meta['scale']}"
             f"{'; SMOKE RUN (tiny config)' if meta['smoke'] else ''}.", ""]
    c = jx.get("ceilings_used") or jx.get("ceilings")
    if c and "error" not in c:
        lines += ["| ceiling | measured |", "| --- | --- |",
                  f"| HBM copy bandwidth | {c['hbm_bytes_per_s'] / 1e9:,.0f} GB/s |",
                  f"| GEMV weight read | {c['gemv_bytes_per_s'] / 1e9:,.0f} GB/s |",
                  f"| {c['dtype']} matmul | {c['matmul_flops_per_s'] / 1e12:,.1f} TFLOP/s |", ""]
    lines += ["Decode step (every sequence decodes one token per step):", "",
              "| batch | context | jaxllm ms/token | floor ms | % of floor | HF ms/token |",
              "| --- | --- | --- | --- | --- | --- |"]
    for key in sorted({k for k in list(jx) + list(hf) if k.startswith("decode_b")},
                      key=lambda k: int(k[len("decode_b"):])):
        j, h = jx.get(key), hf.get(key)
        lines.append(f"| {key[len('decode_b'):]} | {(j or h or {}).get('context_len', '')} | "
                     f"{_cell(j, 'median_step_ms', '{:.2f}')} | {_cell(j, 'floor_ms', '{:.2f}')} | "
                     f"{_cell(j, 'fraction_of_floor', '{:.1%}')} | "
                     f"{_cell(h, 'median_step_ms', '{:.1f}')} |")
    lines += ["", "Offline throughput (random prompts, ignore_eos; output tokens/s):", "",
              "| workload | prompts | jaxllm out tok/s | total tok/s | floor out tok/s | % of floor "
              "| HF generate (prompts) | HF generate_batch (prompts) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in [k for k in jx if k.startswith("throughput_")]:
        name, j = key[len("throughput_"):], jx[key]
        s, g = hf.get(f"static_{name}"), hf.get(f"generate_batch_{name}")
        lines.append(f"| {name} | {_cell(j, 'num_requests', '{}')} | "
                     f"{_cell(j, 'output_tokens_per_second')} | {_cell(j, 'tokens_per_second')} | "
                     f"{_cell(j, 'floor_output_tokens_per_s')} | {_cell(j, 'fraction_of_floor', '{:.1%}')} | "
                     f"{_with_prompts(s)} | {_with_prompts(g)} |")
    lines += ["", "Output throughput against concurrency (jaxllm: requests in flight, closed "
              "loop; HF: static batch size):", "",
              "| concurrency | jaxllm out tok/s | HF out tok/s |", "| --- | --- | --- |"]
    for level in sorted(_levels(jx) | _levels(hf)):
        lines.append(f"| {level} | {_cell(jx.get(f'concurrency_{level}'), 'output_tokens_per_second')}"
                     f" | {_cell(hf.get(f'concurrency_{level}'), 'output_tokens_per_second')} |")
    lines += ["", "| target | measured | goal | |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in summary_rows(results)]
    errors = [f"- {side}/{k}: {v['error']}" for side in ("jaxllm", "hf")
              for k, v in results.get(side, {}).items() if isinstance(v, dict) and "error" in v]
    if errors:
        lines += ["", "Errors:", *errors]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    return text


def _with_prompts(item: dict | None) -> str:
    if not _ok(item):
        return _cell(item, "")
    return f"{item['output_tokens_per_second']:,.0f} ({item['num_prompts']})"


def _levels(side: dict) -> set[int]:
    return {int(k.split("_")[1]) for k in side if k.startswith("concurrency_")}


def write_plot(results: dict, out: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib missing: no plot (rerun with --report-only where it is installed)"
    fig, ax = plt.subplots(figsize=(6, 4))
    for side, label in (("jaxllm", "jaxllm"), ("hf", "HF transformers (static batch)")):
        data = results.get(side, {})
        points = sorted((lvl, data[f"concurrency_{lvl}"]["output_tokens_per_second"])
                        for lvl in _levels(data) if _ok(data[f"concurrency_{lvl}"]))
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{results['jaxllm'].get('env', {}).get('plan', {}).get('model', '')} on "
                 f"{results['jaxllm'].get('env', {}).get('device', '')}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = os.path.join(out, "throughput_vs_concurrency.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny config, small counts")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every prompt count")
    parser.add_argument("--long", action="store_true", help="add the 1000/1000 x 1000 workload")
    parser.add_argument("--hf-scale", type=float, default=None,
                        help="prompt-count scale of the HF peer (default: --scale)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="whole-suite wall budget")
    parser.add_argument("--jaxllm-share", type=float, default=0.62,
                        help="fraction of the budget for the jaxllm worker")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    start = time.time()
    meta_path = os.path.join(a.out, "results.json")
    if a.report_only:
        meta = _load(meta_path)["meta"]
    else:
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "commit": _git_commit(), "smoke": a.smoke, "scale": a.scale, "workers": {}}
        end = start + a.budget_s - 15  # time for the report
        meta["workers"]["jaxllm"] = run_worker("jaxllm", a, start + a.jaxllm_share * a.budget_s)
        if not a.skip_hf:
            meta["workers"]["hf"] = run_worker("hf", a, end)
    results = {"meta": meta, "jaxllm": _load(os.path.join(a.out, "jaxllm.json")),
               "hf": _load(os.path.join(a.out, "hf.json"))}
    with open(meta_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    report = write_report(results, a.out)
    plot = write_plot(results, a.out)
    print("\n" + report, flush=True)
    print(f"plot: {plot}\nresults: {meta_path}\nsuite wall time {time.time() - start:.0f}s")
    print("\nSUMMARY")
    for row in summary_rows(results):
        print(f"  {row[0]:<40} {row[1]:<34} {row[2]:<20} {row[3]}")
    print(flush=True)


if __name__ == "__main__":
    main()
