"""benchmarks/load_test.py for 25 s: cancelled clients, streams and n up to 3 leave no error, no
busy block and no greedy output that differs from a quiet run."""

from __future__ import annotations

import importlib.util
import os
import sys


def test_short_load_run(tiny_llama_dir):
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "load_test.py")
    spec = importlib.util.spec_from_file_location("load_test", path)
    load_test = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = load_test  # dataclasses look their module up
    spec.loader.exec_module(load_test)
    summary = load_test.main(["--duration", "25", "--clients", "32", "--prompts", "8",
                              "--model", tiny_llama_dir,
                              "--server-args=--enforce-eager", "--rss-tolerance", "1.0"])
    assert summary["num_unintended_errors"] == 0, summary["unintended_errors"]
    assert summary["num_greedy_mismatches"] == 0, summary["greedy_mismatches"]
    assert summary["completed"] >= 10 and summary["cancelled"] >= 5, summary
    assert summary["final"]["kv_cache_usage_perc"] == 0
    assert summary["final"]["num_free_blocks"] == summary["idle_free_blocks"]
    assert summary["ok"], summary
