"""vLLM-named metrics of one emulated engine, rendered in the Prometheus text format.

Names, label names and histogram buckets follow vLLM v1's ``vllm/v1/metrics/loggers.py`` so that a
scraper written for real vLLM reads the emulator unchanged (counters get ``_total`` in the
exposition, as prometheus_client renders them). Busy time is accounted per step so GPU utilization
is ``busy / elapsed``, with a binned series for plots.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, then +Inf)."""

    __slots__ = ("_edges", "buckets", "count", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self._edges = np.asarray(buckets, np.float64)
        self.counts = [0] * (len(buckets) + 1)  # per-bucket (non-cumulative); last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float, weight: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += weight
        self.sum += v * weight
        self.count += weight

    def observe_gaps(self, times: list[float] | np.ndarray, weight: int = 1) -> None:
        """Each gap between consecutive ``times`` observed ``weight`` times (a decode stretch's step
        ends, a list or a float64 array, one gap per sequence of its batch): in Python for a few,
        in numpy for many."""
        if len(times) <= 64:
            if isinstance(times, np.ndarray):
                times = times.tolist()
            b, c = self.buckets, self.counts
            s = 0.0
            for t0, t1 in itertools.pairwise(times):
                v = t1 - t0
                c[bisect.bisect_left(b, v)] += weight
                s += v
            self.sum += s * weight
            self.count += (len(times) - 1) * weight
        else:
            self.observe_array(np.diff(times), weight)

    def observe_array(self, values: np.ndarray, weight: int = 1) -> None:
        """Each value observed ``weight`` times (one decode step's gap for each of its sequences), in
        numpy (a decode stretch's thousands of steps).
        The buckets are the same (``searchsorted`` left is ``bisect_left``); the sum may differ from
        a sequential one in the last bits."""
        idx = np.searchsorted(self._edges, values, "left")
        for i, c in enumerate(np.bincount(idx, minlength=len(self.counts)).tolist()):
            if c:
                self.counts[i] += c * weight
        self.sum += float(values.sum()) * weight
        self.count += len(values) * weight

    def cumulative(self) -> list[int]:
        out, acc = [], 0
        for x in self.counts:
            acc += x
            out.append(acc)
        return out


class EngineMetrics:
    """Counters, gauges and histograms of one engine, plus busy-time accounting."""

    def __init__(self, model_name: str, engine: str = "0", util_bin_s: float = 1.0):
        self.model_name = model_name
        self.engine = engine
        self.util_bin_s = util_bin_s
        # Unix time the series were created (prometheus_client's `_created` samples), set by whoever
        # knows the wall clock (the HTTP server); None renders no `_created` series.
        self.created: float | None = None
        # gauges (set by the engine after each step)
        self.num_requests_running = 0
        self.num_requests_waiting = 0
        self.kv_cache_usage_perc = 0.0
        # counters
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.prompt_tokens_by_source = dict.fromkeys(SOURCES, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.request_success = 0
        self.request_errors = 0
        self.kv_transfer_failures = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_seconds = 0.0
        self.kv_transfers = 0
        self.cpu_load_bytes = 0
        self.remote_load_bytes = 0
        self.num_steps = 0
        # histograms
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        # busy time
        self.busy_s = 0.0
        self.t0: float | None = None
        self._bins: dict[int, float] = {}

    # ---- busy time -----------------------------------------------------------------------------
    def add_busy(self, start: float, end: float) -> None:
        if end <= start:
            return
        self.busy_s += end - start
        w = self.util_bin_s
        b0, b1 = int(start // w), int(end // w)
        bins = self._bins
        if b0 == b1:
            bins[b0] = bins.get(b0, 0.0) + (end - start)
            return
        bins[b0] = bins.get(b0, 0.0) + ((b0 + 1) * w - start)
        for b in range(b0 + 1, b1):
            bins[b] = w
        if end > b1 * w:
            bins[b1] = bins.get(b1, 0.0) + (end - b1 * w)

    def utilization(self, now: float) -> float:
        """GPU utilization = busy / elapsed since the engine started (0 before any time passed)."""
        if self.t0 is None or now <= self.t0:
            return 0.0
        return min(1.0, self.busy_s / (now - self.t0))

    def utilization_series(self, now: float | None = None) -> list[tuple[float, float]]:
        """[(bin start time, busy fraction)] for every bin from the first busy one to the last."""
        if not self._bins:
            return []
        w = self.util_bin_s
        lo = min(self._bins)
        hi = max(self._bins) if now is None else max(max(self._bins), int(now // w))
        return [(b * w, self._bins.get(b, 0.0) / w) for b in range(lo, hi + 1)]

    # ---- exposition ----------------------------------------------------------------------------
    def families(self, extra: Iterable[Metric] = ()) -> list[Metric]:
        """Every metric as a prometheus_client family, with vLLM's names, labels and help texts."""
        keys = ["engine", "model_name"]
        vals = [self.engine, self.model_name]
        out: list[Metric] = []

        def gauge(name: str, v: float, help_: str) -> None:
            f = GaugeMetricFamily(name, help_, labels=keys)
            f.add_metric(vals, float(v))
            out.append(f)

        def counter(name: str, v: float, help_: str, extra_labels: dict[str, str] | None = None) -> None:
            ex = extra_labels or {}
            f = CounterMetricFamily(name, help_, labels=keys + list(ex))
            f.add_metric(vals + list(ex.values()), float(v), created=self.created)
            out.append(f)

        def hist(name: str, h: Histogram, help_: str) -> None:
            f = HistogramMetricFamily(name, help_, labels=keys)
            cum = h.cumulative()
            buckets = [(_le(le), float(c)) for le, c in zip(h.buckets, cum)] + [("+Inf", float(cum[-1]))]
            f.add_metric(vals, buckets, float(h.sum))
            if self.created is not None:  # HistogramMetricFamily takes no `created=`
                f.samples.append(Sample(f"{name}_created", dict(zip(keys, vals)), self.created))
            out.append(f)

        gauge("vllm:num_requests_running", self.num_requests_running, "Number of requests in model execution batches.")
        gauge("vllm:num_requests_waiting", self.num_requests_waiting, "Number of requests waiting to be processed.")
        gauge("vllm:kv_cache_usage_perc", self.kv_cache_usage_perc, "KV-cache usage. 1 means 100 percent usage.")
        counter("vllm:prefix_cache_queries", self.prefix_cache_queries,
                "Prefix cache queries, in terms of number of queried tokens.")
        counter("vllm:prefix_cache_hits", self.prefix_cache_hits,
                "Prefix cache hits, in terms of number of cached tokens.")
        counter("vllm:external_prefix_cache_queries", self.external_prefix_cache_queries,
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.")
        counter("vllm:external_prefix_cache_hits", self.external_prefix_cache_hits,
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.")
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                        labels=[*keys, "source"])
        for src in SOURCES:
            by_source.add_metric([*vals, src], float(self.prompt_tokens_by_source[src]), created=self.created)
        out.append(by_source)
        counter("vllm:prompt_tokens", self.prompt_tokens, "Number of prefill tokens processed.")
        counter("vllm:generation_tokens", self.generation_tokens, "Number of generation tokens processed.")
        counter("vllm:num_preemptions", self.num_preemptions, "Cumulative number of preemption from the engine.")
        counter("vllm:request_success", self.request_success, "Count of successfully processed requests.",
                {"finished_reason": "length"})
        hist("vllm:time_to_first_token_seconds", self.ttft, "Histogram of time to first token in seconds.")
        hist("vllm:inter_token_latency_seconds", self.itl, "Histogram of inter-token latency in seconds.")
        hist("vllm:e2e_request_latency_seconds", self.e2e, "Histogram of e2e request latency in seconds.")
        hist("vllm:request_queue_time_seconds", self.queue_time,
             "Histogram of time spent in WAITING phase for request.")
        hist("vllm:request_prefill_time_seconds", self.prefill_time,
             "Histogram of time spent in PREFILL phase for request.")
        hist("vllm:request_decode_time_seconds", self.decode_time,
             "Histogram of time spent in DECODE phase for request.")
        # gpuhit extensions (not vLLM names): transfer accounting and busy time
        counter("gpuhit:kv_transfer_failures", self.kv_transfer_failures,
                "KV transfers that could not be served (unknown or expired transfer_id); recomputed instead.")
        counter("gpuhit:kv_transfer_bytes", self.kv_transfer_bytes, "Bytes received by KV transfers.")
        counter("gpuhit:kv_transfer_seconds", self.kv_transfer_seconds, "Loop seconds spent in KV transfers.")
        counter("gpuhit:engine_busy_seconds", self.busy_s, "Seconds the emulated GPU spent executing steps.")
        out.extend(extra)
        return out

    def render_prometheus(self, extra: Iterable[Metric] = ()) -> str:
        """The Prometheus text exposition of every metric (plus ``extra`` families), rendered by
        prometheus_client exactly as vLLM's ``/metrics`` is (counters get ``_total``)."""
        return render(self.families(extra))


def _le(bound: float) -> str:
    # prometheus_client writes bucket bounds as floatToGoString does: 0.5 -> "0.5", 1 -> "1.0"
    return floatToGoString(bound)


class _Families:
    """A one-shot collector: the families built for one scrape."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def render(families: Iterable[Metric]) -> str:
    """Prometheus text exposition of ``families`` through prometheus_client's own renderer."""
    fams = list(families)
    for f in fams:
        # vLLM's multiprocess collector writes labels sorted by name (engine, le, model_name)
        f.samples = [s._replace(labels=dict(sorted(s.labels.items()))) for s in f.samples]
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families(fams))  # type: ignore[arg-type]
    return generate_latest(reg).decode()
