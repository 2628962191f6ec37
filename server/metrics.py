"""Prometheus text exposition of the engine's stats, with vLLM's metric names under `jaxllm:`.

Written by hand (the format is a few lines per metric) instead of depending on prometheus_client.
Gauges and counters come from the engine's stats; the latency histograms are observed by the
server, which sees each request's first output and its end.
"""

from __future__ import annotations

import bisect
import time

from starlette.responses import Response

from jaxllm.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, stats key, type, help)
_ENGINE_METRICS = (
    ("num_requests_running", "num_running", "gauge", "Number of requests in model execution."),
    ("num_requests_waiting", "num_waiting", "gauge", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("num_free_blocks", "num_free_blocks", "gauge", "Number of free KV-cache blocks."),
    ("num_preemptions_total", "num_preemptions_total", "counter",
     "Cumulative number of preemptions from the engine."),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Number of prefill tokens processed."),
    ("generation_tokens_total", "generation_tokens_total", "counter",
     "Number of generation tokens processed."),
    ("num_requests_aborted_total", "num_aborted_total", "counter",
     "Number of requests aborted before they finished (client disconnects included)."),
)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help_text, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def render(self, labels: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines.append(f"{self.name}_count{{{labels}}} {cumulative}")
        lines.append(f"{self.name}_sum{{{labels}}} {self.total!r}")
        return lines


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        self.labels = f'model_name="{escaped}"'
        self.ttft = Histogram("jaxllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.tpot = Histogram("jaxllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.", _TPOT_BUCKETS)
        self.e2e = Histogram("jaxllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", _E2E_BUCKETS)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(self, engine_stats: dict) -> Response:
        lines = []
        for name, key, kind, help_text in _ENGINE_METRICS:
            lines += _sample(name, kind, help_text, self.labels, engine_stats[key])
        for histogram in (self.ttft, self.tpot, self.e2e):
            lines += histogram.render(self.labels)
        return Response("\n".join(lines) + "\n", media_type=CONTENT_TYPE)


def _sample(name: str, kind: str, help_text: str, labels: str, value: float) -> list[str]:
    return [f"# HELP jaxllm:{name} {help_text}", f"# TYPE jaxllm:{name} {kind}",
            f"jaxllm:{name}{{{labels}}} {float(value)!r}"]


class RequestTimer:
    """Follows one engine request: TTFT at its first output, then TPOT and end-to-end latency
    once it finishes (aborted requests record no latencies, as in vLLM)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token_time: float | None = None

    def on_output(self, output: RequestOutput) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
            self.metrics.ttft.observe(self.first_token_time - self.start)
        if output.finished:
            self._on_finished(max(len(c.token_ids) for c in output.outputs))

    def _on_finished(self, num_tokens_per_sequence: int) -> None:
        end = time.perf_counter()
        self.metrics.e2e.observe(end - self.start)
        if num_tokens_per_sequence > 1:
            self.metrics.tpot.observe((end - self.first_token_time) / (num_tokens_per_sequence - 1))
