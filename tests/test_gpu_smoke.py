"""benchmarks/gpu_smoke.py: its verdicts, and its --cpu matrix end to end (a failing case does not
end the matrix; n-gram speculation's greedy tokens equal the plain engine's; a LoRA case
starts and generates)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import gpu_smoke  # noqa: E402


def _row(backend, tokens, tops, **extra):
    case = gpu_smoke.Case("llama-tiny", "bfloat16", 2048, 16, 8, backend)
    row = {"case": case.name, **gpu_smoke.asdict(case), "tokens": tokens, "top_logprobs": tops}
    row.update(extra)
    return row


def test_judge_accepts_agreement_and_near_ties_only():
    tops = [[[-0.1, -3.0], [-0.2, -0.21], [-0.1, -2.0]]]  # a near tie at step 1
    rows = [_row("pallas", [[5, 6, 7]], tops), _row("triton", [[5, 6, 7]], tops),
            _row("xla", [[5, 9, 7]], tops), _row("mosaic", [[8, 6, 7]], tops)]
    gpu_smoke.judge(rows)
    verdicts = {row["backend"]: row["verdict"] for row in rows}
    assert verdicts["pallas"].startswith("FAIL") and "mosaic" in verdicts["pallas"]
    assert verdicts["xla"].startswith("FAIL") and "mosaic" in verdicts["xla"]
    assert verdicts["mosaic"].startswith("FAIL")  # parts at step 0, no tie there


def test_judge_flags_non_finite_logprobs_and_unexpected_outcomes():
    rows = [_row("pallas", [[5]], [[[float("nan"), -1.0]]]),
            _row("triton", [[5]], [[[-0.5, -1.0]]], expect_error=True),
            {**_row("xla", [[5]], []), "error": "ValueError: boom"}]
    del rows[2]["tokens"]
    gpu_smoke.judge(rows)
    assert [row["verdict"] for row in rows] == [
        "FAIL: non-finite logprobs", "FAIL: started, but an error was expected",
        "FAIL: ValueError: boom"]


def test_judge_compares_pooling_cases_by_cosine():
    def row(backend, embeddings):
        case = gpu_smoke.Case("bert-tiny", "float16", 512, 16, 8, backend, pooling=True)
        return {"case": case.name, **gpu_smoke.asdict(case), "embeddings": embeddings}
    close = [row("auto", [[1.0, 2.0, 3.0]]), row("xla", [[1.0, 2.0, 3.001]])]
    apart = [row("auto", [[1.0, 2.0, 3.0]]), row("xla", [[1.0, -2.0, 3.0]])]
    gpu_smoke.judge(close)
    gpu_smoke.judge(apart)
    assert [r["verdict"] for r in close] == ["ok (1 peers agree)"] * 2
    assert all(r["verdict"].startswith("FAIL: embeddings differ") for r in apart)


def test_matrix_covers_every_value_of_every_axis():
    cases = [c for c in gpu_smoke.gpu_matrix(num_gpus=2) if not c.pooling]
    for axis, values in (("max_num_seqs", {1, 2, 8, 256}), ("max_model_len", {777, 2048, 8192}),
                         ("block_size", {16, 32, 64}),
                         ("dtype", {"bfloat16", "float16", "float32"}),
                         ("backend", {"pallas", "triton", "mosaic", "xla"}), ("tp", {1, 2}),
                         ("dp", {1, 2}), ("pp", {1, 2})):
        assert {getattr(case, axis) for case in cases} == values, axis
    for backend in ("pallas", "triton", "mosaic", "xla"):  # each with small and default seqs
        assert {c.max_num_seqs for c in cases if c.backend == backend} & {1, 2, 8}
        assert 256 in {c.max_num_seqs for c in cases if c.backend == backend}
    assert not [c for c in cases if c.backend == "mosaic" and c.dtype == "float32"]
    assert {c.num_gpus for c in gpu_smoke.gpu_matrix(num_gpus=1)} == {1}
    pooling = [c for c in gpu_smoke.gpu_matrix(num_gpus=1) if c.pooling]  # both attentions
    assert {(c.backend, c.max_num_seqs) for c in pooling} >= {("auto", 1), ("auto", 256),
                                                              ("xla", 1), ("xla", 256)}


def test_cpu_matrix_runs_and_isolates_a_failing_case(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_smoke.py"),
                          "--cpu", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    with open(tmp_path / "gpu_smoke.json") as f:
        report = json.load(f)
    verdicts = sorted(row["verdict"] for row in report["cases"])
    # LoRA, the GPTQ checkpoint, the FP8 one with KV scales, the block-wise and the static FP8
    # ones in groups of their own; plain seqs 1 and 8, n-gram, EAGLE and the draft model
    # agreeing with each other; the two pooling cases' embeddings
    assert report["ok"] and verdicts == (["expected error"] + ["ok (0 peers agree)"] * 5
                                         + ["ok (1 peers agree)"] * 2
                                         + ["ok (4 peers agree)"] * 5), verdicts
    assert (tmp_path / "gpu_smoke.md").read_text().count("| llama-tiny") == 11
    assert out.stdout.count("llama-tiny") >= 18  # a progress row per case, then the table


def test_an_exclusive_case_runs_with_nothing_beside_it(tmp_path, monkeypatch):
    """The matrix runs small cases side by side, and a case marked alone (as the FP8 MoE) with
    no other case on the device, before or after it."""
    live, seen = set(), {}

    class Proc:  # finishes at its second poll
        def __init__(self, name):
            self.name, self.polls = name, 0

        def poll(self):
            self.polls += 1
            if self.polls < 2:
                return None
            live.discard(self.name)
            return 0

    def launch(case, out_dir, index):
        live.add(case.name)
        seen[case.name] = set(live)
        return Proc(case.name), gpu_smoke.time.perf_counter()

    monkeypatch.setattr(gpu_smoke, "_launch", launch)
    monkeypatch.setattr(gpu_smoke, "_finish", lambda case, *_: {"case": case.name})
    monkeypatch.setattr(gpu_smoke, "_print_row", lambda row: None)
    monkeypatch.setattr(gpu_smoke.time, "sleep", lambda s: None)
    small = [gpu_smoke.Case("llama-tiny", "bfloat16", 2048, 16, s, "pallas") for s in (1, 2, 8)]
    big = gpu_smoke.Case("qwen3-30b-a3b", "bfloat16", 2048, 16, 8, "pallas", utilization=0.6,
                         alone=True)
    rows = gpu_smoke.run_matrix([small[0], big, *small[1:]], str(tmp_path), jobs=8,
                                timeout_s=60)
    assert sorted(r["case"] for r in rows) == sorted(c.name for c in [big, *small])
    assert seen[big.name] == {big.name}
    assert max(len(names) for names in seen.values()) == 3  # the small ones together
    assert [c.name for c in gpu_smoke.gpu_matrix(num_gpus=1) if c.exclusive] == [
        big.name + " q-fp8"]
