"""benchmarks/profile_decode.py's trace summary: the GPU's busy time a step counts each moment
of its streams once, and nothing outside them."""

import gzip
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import profile_decode  # noqa: E402


def _meta(kind, pid, name, tid=None):
    event = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
    return event if tid is None else {**event, "tid": tid}


def _span(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_the_streams_events(tmp_path):
    events = [
        _meta("process_name", 1, "/device:GPU:0"), _meta("process_name", 2, "/host:CPU"),
        _meta("thread_name", 1, "Stream #13(Compute)", tid=7),
        _meta("thread_name", 1, "Stream #14(MemcpyH2D)", tid=8),
        _meta("thread_name", 1, "XLA Modules", tid=9),
        # two overlapping kernels, one after a gap, a copy inside the gap on another stream
        _span(1, 7, "gemv", 0, 10), _span(1, 7, "attention", 5, 10),
        _span(1, 7, "gemv", 30, 10), _span(1, 8, "MemcpyH2D", 18, 4),
        _span(1, 9, "jit_step", 0, 50),  # the module's whole run: not a kernel
        _span(2, 3, "ExecuteThunks", 0, 100),
    ]
    path = tmp_path / "plugins" / "profile" / "run"
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = profile_decode.kernel_summary(str(tmp_path), num_steps=2)
    # [0, 15) + [18, 22) + [30, 40) = 29 us over 2 steps
    assert summary["busy_us_per_step /device:GPU:0"] == 14.5
    assert "busy_us_per_step /host:CPU" not in summary
    assert summary["events_per_step /device:GPU:0"] == 2.5
    assert dict(summary["top_us_per_step /device:GPU:0"])["gemv"] == 10.0


def test_busy_us_merges_nested_and_touching_intervals():
    assert profile_decode.busy_us([]) == 0
    assert profile_decode.busy_us([(0, 10), (2, 3), (10, 12), (20, 21)]) == 13


def test_every_kernel_counts_by_kind(tmp_path):
    events = [
        _meta("process_name", 1, "/device:GPU:0"),
        _meta("thread_name", 1, "Stream #13(Compute)", tid=7),
        _meta("thread_name", 1, "XLA Ops", tid=9),
        _span(1, 7, "fp8_gemv", 0, 4), _span(1, 7, "fp8_gemv__12", 4, 6),
        _span(1, 7, "loop_add_fusion_63", 10, 2), _span(1, 7, "memcpy32_post", 12, 1),
        _span(1, 9, "fp8_gemv", 0, 10),  # the op's line, not a kernel
    ]
    path = tmp_path / "plugins" / "profile" / "run"
    path.mkdir(parents=True)
    with gzip.open(path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = profile_decode.kernel_summary(str(tmp_path), num_steps=1, top=1)
    assert summary["kind_us_per_step /device:GPU:0"] == [
        ("fp8_gemv", 10.0), ("loop_add_fusion", 2.0), ("memcpy32_post", 1.0)]
    assert summary["kernel_us_per_step /device:GPU:0"] == 13.0
    assert len(summary["top_us_per_step /device:GPU:0"]) == 1  # the top by name: cut at `top`
