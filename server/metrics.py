"""/metrics through prometheus-client: vLLM's metric names, types, buckets and labels, under the
`vllm:` prefix (vLLM's Grafana dashboards work unmodified), `jaxllm:`, or both (--metrics-prefix).

Each metric exists once, unprefixed, in a private registry; the app's registry re-exposes it under
every chosen prefix (`_Prefixed`) beside prometheus-client's process, platform and GC collectors.
Every app has its own registries, so several apps live in one process (tests).

Engine-wide values (running/waiting requests, KV usage, token and preemption counters) are read
from the engine's stats at scrape time. Per-request histograms are observed by the server from each
request's output stream, with time.monotonic() timestamps:
  arrival       the server's receipt of the request;
  scheduled     `first_scheduled_time` in RequestOutput.metrics when the engine reports it, else
                the arrival (queue time then reads 0 and prefill time holds the queueing);
  first token   the first output the server receives; last token: each sequence's last output.
An inter-token latency spreads the time between two outputs over the tokens the later one added.
A request whose client left records nothing here (its abort counts in num_requests_aborted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram,
                               PlatformCollector, ProcessCollector, generate_latest)
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, Metric)
from starlette.responses import Response

from jaxllm.engine.engine_core import ITERATION_TOKENS_BUCKETS
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.sampling_params import SamplingParams

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIXES = {"vllm": ("vllm",), "jaxllm": ("jaxllm",), "both": ("vllm", "jaxllm")}
LABELS = ("model_name", "engine")
# vLLM's FinishReason strings: every series exists from the start, at 0.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)

# (name, engine stats key, help); counters' names carry no _total (prometheus-client adds it).
_ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    ("gpu_cache_usage_perc", "kv_cache_usage",
     "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use kv_cache_usage_perc."),
    ("num_free_blocks", "num_free_blocks", "Number of free KV-cache blocks."),
)
_ENGINE_COUNTERS = (
    ("num_preemptions", "num_preemptions_total",
     "Cumulative number of preemption from the engine."),
    ("prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
    ("num_requests_aborted", "num_aborted_total",
     "Number of requests aborted before they finished (client disconnects included)."),
    ("prefix_cache_queries", "prefix_cache_queries_total",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hits_total",
     "Prefix cache hits, in terms of number of cached tokens."),
)

# Speculative decoding (vLLM's SpecDecodingProm), present only when the engine speculates.
_SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "spec_decode_num_drafts_total", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens_total",
     "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_total",
     "Number of accepted tokens."),
)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM's token-count histograms."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 2048,
                 cache_config_info: dict | None = None, prefix: str = "both") -> None:
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {tuple(PREFIXES)}, got {prefix!r}.")
        self.labels = (model_name, "0")  # one engine (DP replicas are summed into it)
        self._engine = _EngineStats(self.labels)
        source = CollectorRegistry(auto_describe=True)
        source.register(self._engine)
        self.histograms = _RequestHistograms(source, self.labels, max_model_len)
        success = Counter("request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=source)
        self.request_success = {r: success.labels(*self.labels, r) for r in FINISH_REASONS}
        if cache_config_info is not None:
            info = {**{k: str(v) for k, v in cache_config_info.items()}, "engine": "0"}
            Gauge("cache_config_info", "Information of the LLMEngine CacheConfig",
                  tuple(info), registry=source).labels(**info).set(1)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Prefixed(source, PREFIXES[prefix]))
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)

    def timer(self, params: SamplingParams | None = None) -> RequestTimer:
        return RequestTimer(self, params)

    def render(self, engine_stats: dict) -> Response:
        self._engine.stats = engine_stats
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE)


class _RequestHistograms:
    """vLLM's per-request histograms, each bound to this server's label values."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str],
                 max_model_len: int) -> None:
        tokens = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, help_text: str, buckets) -> Histogram:
            return Histogram(name, help_text, LABELS, buckets=buckets,
                             registry=registry).labels(*labels)

        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        # The older name of the same observations, which vLLM's example dashboard still charts.
        self.tpot = histogram("time_per_output_token_seconds",
                              "Histogram of time per output token in seconds. DEPRECATED: Use "
                              "inter_token_latency_seconds.", _ITL_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.",
                                      _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.",
                               _REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.",
                                   _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.",
                                _REQUEST_BUCKETS)
        self.prompt_tokens = histogram("request_prompt_tokens",
                                       "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("request_generation_tokens",
                                           "Number of generation tokens processed.", tokens)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.n = histogram("request_params_n", "Histogram of the n request parameter.",
                           _N_BUCKETS)
        self.max_tokens = histogram("request_params_max_tokens",
                                    "Histogram of the max_tokens request parameter.", tokens)


class _EngineStats:
    """The engine's gauges and counters, read from its latest stats at scrape time."""

    def __init__(self, labels: tuple[str, str]) -> None:
        self.labels = list(labels)
        self.stats: dict = {}

    def collect(self):
        for name, key, help_text in _ENGINE_GAUGES:
            yield self._family(GaugeMetricFamily(name, help_text, labels=LABELS), key)
        for name, key, help_text in _ENGINE_COUNTERS:
            yield self._family(CounterMetricFamily(name, help_text, labels=LABELS), key)
        if "iteration_tokens_counts" in self.stats:
            yield self._iteration_tokens()
        if "spec_decode_num_drafts_total" in self.stats:
            yield from self._spec_decode()
        if "lora_max" in self.stats:
            yield self._lora_requests_info()

    def _lora_requests_info(self) -> Metric:
        """vLLM's: the adapters of the running and the waiting requests as labels, the scrape
        time as the value."""
        family = GaugeMetricFamily("lora_requests_info", "Running stats on lora requests.",
                                   labels=("max_lora", "waiting_lora_adapters",
                                           "running_lora_adapters"))
        stats = self.stats
        family.add_metric([str(stats["lora_max"]), ",".join(stats["lora_waiting"]),
                           ",".join(stats["lora_running"])], time.time())
        return family

    def _iteration_tokens(self) -> Metric:
        family = HistogramMetricFamily("iteration_tokens_total",
                                       "Histogram of number of tokens per engine_step.",
                                       labels=LABELS)
        edges = [str(float(b)) for b in ITERATION_TOKENS_BUCKETS] + ["+Inf"]
        counts = self.stats["iteration_tokens_counts"]
        cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
        family.add_metric(self.labels, list(zip(edges, cumulative)),
                          sum_value=float(self.stats["iteration_tokens_sum"]))
        return family

    def _spec_decode(self):
        for name, key, help_text in _SPEC_DECODE_COUNTERS:
            yield self._family(CounterMetricFamily(name, help_text, labels=LABELS), key)
        per_pos = CounterMetricFamily("spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=(*LABELS, "position"))
        for position, count in enumerate(self.stats["spec_decode_num_accepted_tokens_per_pos"]):
            per_pos.add_metric([*self.labels, str(position)], float(count))
        yield per_pos

    def _family(self, family: Metric, key: str) -> Metric:
        if key in self.stats:  # none before the first scrape
            family.add_metric(self.labels, float(self.stats[key]))
        return family


class _Prefixed:
    """Re-exposes every metric of `source` under each prefix: `prompt_tokens` -> `vllm:...`."""

    def __init__(self, source: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self.source, self.prefixes = source, prefixes

    def collect(self):
        return [_renamed(f, p) for p in self.prefixes for f in self.source.collect()]


def _renamed(family: Metric, prefix: str) -> Metric:
    renamed = Metric(f"{prefix}:{family.name}", family.documentation, family.type, family.unit)
    renamed.samples = [s._replace(name=f"{prefix}:{s.name}") for s in family.samples]
    return renamed


@dataclass
class _Sequence:
    num_tokens: int
    last_token_time: float


class RequestTimer:
    """Follows one engine request (all n of its sequences) through its outputs and records its
    histograms when it finishes; see the module docstring for what each timestamp is."""

    def __init__(self, metrics: ServerMetrics, params: SamplingParams | None = None) -> None:
        self.metrics = metrics
        self.params = params
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.sequences: dict[int, _Sequence] = {}

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
            self.metrics.histograms.ttft.observe(now - self.arrival)
        for completion in output.outputs:
            self._on_tokens(completion, now)
        if output.finished:
            self._on_finished(output, now)

    def _on_tokens(self, completion: CompletionOutput, now: float) -> None:
        sequence = self.sequences.setdefault(completion.index, _Sequence(0, now))
        num_new = len(completion.token_ids) - sequence.num_tokens
        if num_new <= 0:
            return
        if sequence.num_tokens:
            histograms = self.metrics.histograms
            for _ in range(num_new):
                histograms.itl.observe((now - sequence.last_token_time) / num_new)
                histograms.tpot.observe((now - sequence.last_token_time) / num_new)
        sequence.num_tokens, sequence.last_token_time = len(completion.token_ids), now

    def _on_finished(self, output: RequestOutput, now: float) -> None:
        histograms = self.metrics.histograms
        scheduled = output.metrics.get("first_scheduled_time", self.arrival)
        for completion in output.outputs:
            num_tokens = len(completion.token_ids)
            last_token = self.sequences.get(completion.index, _Sequence(0, now)).last_token_time
            self.metrics.request_success[completion.finish_reason].inc()
            histograms.e2e.observe(now - self.arrival)
            histograms.queue.observe(scheduled - self.arrival)
            histograms.prefill.observe(self.first_token_time - scheduled)
            histograms.decode.observe(last_token - self.first_token_time)
            histograms.inference.observe(last_token - scheduled)
            histograms.prompt_tokens.observe(len(output.prompt_token_ids))
            histograms.generation_tokens.observe(num_tokens)
            if num_tokens > 1:
                histograms.request_tpot.observe(
                    (last_token - self.first_token_time) / (num_tokens - 1))
            if self.params is not None and self.params.max_tokens is not None:
                histograms.max_tokens.observe(self.params.max_tokens)
        histograms.n.observe(len(output.outputs))
        histograms.max_generation_tokens.observe(max(len(c.token_ids) for c in output.outputs))
