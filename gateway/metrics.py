"""The gateway's Prometheus metrics: plain running totals, rendered only when scraped.

Per request the hot path does a few dict increments (no label-object creation, no locking: one
event loop); ``render()`` formats everything in the Prometheus text format. Names:

* ``gpuhit_gateway_requests_total{endpoint,code}``
* ``gpuhit_gateway_decisions_total{policy,instance,action}``
* ``gpuhit_gateway_prompt_tokens_total{instance}``, ``gpuhit_gateway_predicted_hit_tokens_total{instance}``,
  ``gpuhit_gateway_realized_hit_tokens_total{instance}`` (realized = engine-reported cached tokens)
* ``gpuhit_gateway_routing_seconds`` histogram (parse + hash + snapshot + decide)
* ``gpuhit_gateway_upstream_errors_total{instance,kind}`` (connect, status, midstream, timeout)
* ``gpuhit_gateway_instance_healthy{instance}`` gauge
* ``gpuhit_gateway_kv_moves_total{action,outcome}``: KV-moving two-steps (migrate, fetch, pd) by
  outcome: ``transferred`` (the target's realized hit covered the moved prefix), ``recomputed``
  (it fell at least a block short: the consumer could not pull and recomputed), ``producer_failed``
  (step 1 failed: the target recomputed the whole prompt), ``unverified`` (no usage reported)
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

ROUTING_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(str(v))}"' for n, v in zip(names, values))
    return "{" + inner + "}"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Counter:
    __slots__ = ("help", "labelnames", "name", "values")

    def __init__(self, name: str, help_: str, labelnames: tuple[str, ...] = ()):
        self.name = name
        self.help = help_
        self.labelnames = labelnames
        self.values: dict[tuple, float] = {}

    def inc(self, labels: tuple = (), amount: float = 1.0) -> None:
        v = self.values
        v[labels] = v.get(labels, 0.0) + amount

    def get(self, labels: tuple = ()) -> float:
        return self.values.get(labels, 0.0)

    def render(self, kind: str = "counter") -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} {kind}"
        for labels, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, labels)} {value:g}"


class Histogram:
    __slots__ = ("buckets", "count", "counts", "help", "name", "sum")

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]):
        self.name = name
        self.help = help_
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        acc = 0
        for bound, c in zip(self.buckets, self.counts):
            acc += c
            yield f'{self.name}_bucket{{le="{bound:g}"}} {acc}'
        yield f'{self.name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{self.name}_sum {self.sum:.9g}"
        yield f"{self.name}_count {self.count}"


class GatewayMetrics:
    def __init__(self) -> None:
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
        self.routing = Histogram("gpuhit_gateway_routing_seconds",
                                 "Time to route one request (parse, hash, snapshot, decide).", ROUTING_BUCKETS)
        self.kv_moves = Counter("gpuhit_gateway_kv_moves_total",
                                "KV-moving two-step requests (migration, fetch, PD) by outcome.", ("action", "outcome"))
        self.healthy = Counter("gpuhit_gateway_instance_healthy", "1 if the instance takes traffic.", ("instance",))
        self.extra: list[Callable[[], Iterable[str]]] = []

    def render(self) -> str:
        lines: list[str] = []
        for c in (self.requests, self.decisions, self.prompt_tokens, self.predicted_hit, self.realized_hit,
                  self.upstream_errors, self.kv_moves):
            lines.extend(c.render())
        lines.extend(self.routing.render())
        lines.extend(self.healthy.render("gauge"))
        for fn in self.extra:
            lines.extend(fn())
        return "\n".join(lines) + "\n"
