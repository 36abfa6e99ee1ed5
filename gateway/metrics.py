"""The gateway's Prometheus metrics, rendered by ``prometheus_client`` from a private registry.

Counters are exact running totals kept in plain dicts (the hot path does a few dict increments:
no label-object lookup, no lock; one event loop) and exported at scrape time by a collector, so a
token counter of 123,456,789 renders as ``1.23456789e+08`` (every digit; prometheus_client's Go
float format), never rounded. Histograms likewise (:class:`Histogram`): a list of bucket counts and
a sum per series, one ``bisect`` per observation (prometheus_client's ``Histogram.observe`` takes
a lock and costs ~1 us, three of them a request), exported with the samples prometheus_client's
own histogram writes (cumulative ``_bucket``, ``_count``, ``_sum``, ``_created``). Each
:class:`GatewayMetrics` owns its :class:`~prometheus_client.CollectorRegistry` (two gateways in
one process never share series). Names:

* ``gpuhit_gateway_requests_total{endpoint,code}``
* ``gpuhit_gateway_decisions_total{policy,instance,action}``
* ``gpuhit_gateway_prompt_tokens_total{instance}``, ``gpuhit_gateway_predicted_hit_tokens_total{instance}``,
  ``gpuhit_gateway_realized_hit_tokens_total{instance}`` (realized = engine-reported cached tokens)
* ``gpuhit_gateway_routing_seconds`` histogram (parse + hash + snapshot + decide, ``perf_counter_ns``)
* ``gpuhit_gateway_request_seconds{endpoint}`` / ``gpuhit_gateway_ttft_seconds{endpoint}`` histograms:
  a routed request from its arrival to its last byte / its first upstream byte
* ``gpuhit_gateway_upstream_errors_total{instance,kind}`` (connect, status, midstream, timeout, producer)
* ``gpuhit_gateway_instance_healthy{instance}``, ``gpuhit_gateway_instance_in_flight{instance}``,
  ``gpuhit_gateway_instance_pending_prefill_tokens{instance}`` gauges (read from the router at scrape time)
* ``gpuhit_gateway_instance_breaker_state{instance}`` (0 closed, 1 half-open, 2 open: ejected) and
  ``gpuhit_gateway_breaker_transitions_total{instance,from,to}`` (:mod:`gateway.breaker`)
* ``gpuhit_gateway_kv_replays_failed_total{instance}``, ``gpuhit_gateway_kv_publisher_restarts_total{instance}``:
  KV-event replays that failed (after their retries), publisher restarts detected (sequence back to 0,
  reconnected socket)
* ``gpuhit_gateway_kv_moves_total{action,outcome}``: KV-moving two-steps (migrate, fetch, pd) by
  outcome: ``transferred`` (the target's realized hit covered the moved prefix), ``recomputed``
  (it fell at least a block short: the consumer could not pull and recomputed), ``producer_failed``
  (step 1 failed: the target recomputed the whole prompt), ``unverified`` (no usage reported)
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as _prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gateway.breaker import STATES

ROUTING_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Counter:
    """A labelled counter as a dict of exact totals (ints stay ints)."""

    __slots__ = ("help", "labelnames", "name", "values")

    def __init__(self, name: str, help_: str, labelnames: tuple[str, ...] = ()):
        self.name = name
        self.help = help_
        self.labelnames = labelnames
        self.values: dict[tuple, int | float] = {}

    def inc(self, labels: tuple = (), amount: float = 1) -> None:
        v = self.values
        v[labels] = v.get(labels, 0) + amount

    def get(self, labels: tuple = ()) -> int | float:
        return self.values.get(labels, 0)

    def family(self) -> Metric:
        # prometheus_client appends _total to a counter family's samples.
        fam = CounterMetricFamily(self.name.removesuffix("_total"), self.help, labels=self.labelnames)
        for labels, value in sorted(self.values.items()):
            fam.add_metric([str(x) for x in labels], value)
        return fam


class _Series:
    """One histogram series: per-bucket counts (not cumulative; the last is +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...], created: float):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.created = created

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, Prometheus' ``le`` (prometheus_client's ``<=``).
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Histogram:
    """A labelled histogram as plain bucket counts per label tuple (see the module docstring).
    ``wall`` gives the series' ``_created`` time (read once per series, never for a measurement)."""

    __slots__ = ("_one", "bounds", "help", "labelnames", "name", "series", "wall")

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...], labelnames: tuple[str, ...] = (),
                 wall: Callable[[], float] = time.time):
        if list(buckets) != sorted(buckets) or len(set(buckets)) != len(buckets):
            raise ValueError(f"histogram {name}: buckets must be strictly increasing, got {buckets}")
        self.name = name
        self.help = help_
        self.labelnames = labelnames
        self.bounds = tuple(float(b) for b in buckets)
        self.wall = wall
        self.series: dict[tuple[str, ...], _Series] = {}
        self._one = None if labelnames else self.labels()

    def labels(self, *values: str) -> _Series:
        """The series of these label values (created, at zero, on first use)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"histogram {self.name} takes labels {self.labelnames}, got {values}")
        s = self.series.get(values)
        if s is None:
            s = self.series[values] = _Series(self.bounds, self.wall())
        return s

    def observe(self, value: float) -> None:
        """Observe ``value`` in the unlabelled histogram's one series."""
        assert self._one is not None, "a labelled histogram is observed through labels(...)"
        self._one.observe(value)

    def family(self) -> Metric:
        """The samples prometheus_client's own histogram writes, series by series: cumulative
        ``_bucket`` (``le`` as Go floats, then +Inf), ``_count``, ``_sum``, ``_created`` (unless
        prometheus_client's created series are disabled)."""
        fam = Metric(self.name, self.help, "histogram")
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        created = _prometheus_metrics._use_created
        for values, s in self.series.items():
            labels = dict(zip(self.labelnames, values))
            acc = 0.0
            for le, n in zip(les, s.counts):
                acc += n
                fam.samples.append(Sample(self.name + "_bucket", {**labels, "le": le}, acc))
            fam.samples.append(Sample(self.name + "_count", labels, acc))
            fam.samples.append(Sample(self.name + "_sum", labels, s.sum))
            if created:
                fam.samples.append(Sample(self.name + "_created", labels, s.created))
        return fam


class _Collector:
    """Exports the dict counters and the per-instance gauges when the registry is scraped."""

    def __init__(self, m: GatewayMetrics):
        self.m = m

    def describe(self) -> list[Metric]:
        return []  # no up-front description: collect() runs only at scrape time

    def collect(self) -> Iterable[Metric]:
        m = self.m
        for h in m.histograms:
            yield h.family()
        for c in m.counters:
            yield c.family()
        healthy = GaugeMetricFamily("gpuhit_gateway_instance_healthy", "1 if the instance takes traffic.",
                                    labels=("instance",))
        for (name,), v in sorted(m.healthy.items()):
            healthy.add_metric([name], v)
        yield healthy
        if m.instances is not None:
            inflight = GaugeMetricFamily("gpuhit_gateway_instance_in_flight",
                                         "Requests the gateway has routed to the instance and not finished.",
                                         labels=("instance",))
            pending = GaugeMetricFamily("gpuhit_gateway_instance_pending_prefill_tokens",
                                        "Prompt tokens routed to the instance whose prefill has not finished "
                                        "(no first token yet).", labels=("instance",))
            for name, counts in m.instances():
                inflight.add_metric([name], counts["in_flight"])
                pending.add_metric([name], counts["pending_prefill_tokens"])
            yield inflight
            yield pending
        if m.breakers is not None:
            state = GaugeMetricFamily("gpuhit_gateway_instance_breaker_state",
                                      "Circuit breaker: 0 closed, 1 half-open (probing), 2 open (ejected).",
                                      labels=("instance",))
            moves = CounterMetricFamily("gpuhit_gateway_breaker_transitions", "Circuit breaker state changes.",
                                        labels=("instance", "from", "to"))
            for name, b in m.breakers():
                state.add_metric([name], STATES.index(b.state))
                for (a, z), n in sorted(b.transitions.items()):
                    moves.add_metric([name, a, z], n)
            yield state
            yield moves
        if m.kv_streams is not None:
            failed = CounterMetricFamily("gpuhit_gateway_kv_replays_failed",
                                         "KV-event replays that failed after their retries (the instance's index "
                                         "was cleared).", labels=("instance",))
            restarts = CounterMetricFamily("gpuhit_gateway_kv_publisher_restarts",
                                           "KV-event publisher restarts detected (index cleared and replayed).",
                                           labels=("instance",))
            for name, st in m.kv_streams():
                failed.add_metric([name], st["replays_failed"])
                restarts.add_metric([name], st["restarts"])
            yield failed
            yield restarts
        for fn in m.extra:
            yield from fn()


class GatewayMetrics:
    """Every metric of one gateway; ``render()`` is the ``/metrics`` body (``CONTENT_TYPE``).
    ``wall`` is the clock of the histograms' ``_created`` series (prometheus_client's: Unix time);
    ``endpoints``: the routed paths (the gateway's prompt dialects), each with its latency series."""

    def __init__(self, wall: Callable[[], float] = time.time,
                 endpoints: Iterable[str] = ("/v1/completions", "/v1/chat/completions")) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("gpuhit_gateway_requests_total", "Requests answered, by endpoint and HTTP status.",
                                ("endpoint", "code"))
        self.decisions = Counter("gpuhit_gateway_decisions_total", "Routing decisions.",
                                 ("policy", "instance", "action"))
        self.prompt_tokens = Counter("gpuhit_gateway_prompt_tokens_total", "Prompt tokens routed.", ("instance",))
        self.predicted_hit = Counter("gpuhit_gateway_predicted_hit_tokens_total",
                                     "Prefix-hit tokens the KV index predicted at routing time.", ("instance",))
        self.realized_hit = Counter("gpuhit_gateway_realized_hit_tokens_total",
                                    "Cached prompt tokens the engine reported (usage.prompt_tokens_details).",
                                    ("instance",))
        self.upstream_errors = Counter("gpuhit_gateway_upstream_errors_total", "Failed upstream requests.",
                                       ("instance", "kind"))
        self.kv_moves = Counter("gpuhit_gateway_kv_moves_total",
                                "KV-moving two-step requests (migration, fetch, PD) by outcome.", ("action", "outcome"))
        self.counters = (self.requests, self.decisions, self.prompt_tokens, self.predicted_hit, self.realized_hit,
                         self.upstream_errors, self.kv_moves)
        self.healthy: dict[tuple[str], float] = {}
        # () -> [(instance name, router counters)]: set by the gateway once its router exists.
        self.instances: Callable[[], Iterable[tuple[str, dict[str, int]]]] | None = None
        # () -> [(instance name, CircuitBreaker)] and [(instance name, KV subscriber totals)]: set by the gateway.
        self.breakers: Callable[[], Iterable[tuple[str, Any]]] | None = None
        self.kv_streams: Callable[[], Iterable[tuple[str, dict[str, int]]]] | None = None
        self.extra: list[Callable[[], Iterable[Metric]]] = []
        self.routing = Histogram("gpuhit_gateway_routing_seconds",
                                 "Time to route one request (parse, hash, snapshot, decide).", ROUTING_BUCKETS,
                                 wall=wall)
        self.latency = Histogram("gpuhit_gateway_request_seconds",
                                 "Routed requests: arrival to the answer's last byte (errors included).",
                                 LATENCY_BUCKETS, ("endpoint",), wall=wall)
        self.ttft = Histogram("gpuhit_gateway_ttft_seconds", "Routed requests: arrival to the engine's first answer byte.",
                              LATENCY_BUCKETS, ("endpoint",), wall=wall)
        self.histograms = (self.routing, self.latency, self.ttft)
        self._routing = self.routing.labels()
        endpoints = tuple(endpoints)
        self._latency = {e: self.latency.labels(e) for e in endpoints}
        self._ttft = {e: self.ttft.labels(e) for e in endpoints}
        self.registry.register(_Collector(self))

    # A request's counter updates are two calls, their dict increments and histogram observations
    # inline (_Series.observe written out): a method call per series (eight of them) cost more than
    # the increments.

    def routed(self, policy: str, instance: str, action: str, prompt_tokens: int, predicted_hit: int,
               seconds: float) -> None:
        """One routing decision: the decision, its prompt and predicted-hit tokens on ``instance``,
        and the time routing took."""
        k: tuple = (policy, instance, action)
        v = self.decisions.values
        v[k] = v.get(k, 0) + 1
        k = (instance,)
        v = self.prompt_tokens.values
        v[k] = v.get(k, 0) + prompt_tokens
        v = self.predicted_hit.values
        v[k] = v.get(k, 0) + predicted_hit
        h = self._routing
        h.counts[bisect.bisect_left(h.bounds, seconds)] += 1
        h.sum += seconds

    def succeeded(self, endpoint: str, instance: str, cached_tokens: int | None) -> None:
        """A 200 answer to ``endpoint`` from ``instance``, which reported ``cached_tokens`` prompt
        tokens served from its prefix cache (None: it reported no usage)."""
        k: tuple = (endpoint, "200")
        v = self.requests.values
        v[k] = v.get(k, 0) + 1
        if cached_tokens is not None:
            k = (instance,)
            v = self.realized_hit.values
            v[k] = v.get(k, 0) + cached_tokens

    def answered(self, endpoint: str, latency: float, ttft: float | None) -> None:
        """A routed request's latency (arrival to last byte) and, when an engine answered, its TTFT."""
        h = self._latency[endpoint]
        h.counts[bisect.bisect_left(h.bounds, latency)] += 1
        h.sum += latency
        if ttft is not None:
            h = self._ttft[endpoint]
            h.counts[bisect.bisect_left(h.bounds, ttft)] += 1
            h.sum += ttft

    def render(self) -> str:
        return generate_latest(self.registry).decode()
