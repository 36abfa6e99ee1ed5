"""Load-only and affinity-only baselines: round_robin, least_request, sticky.

Tie-breaks (deterministic): round_robin has none (one position per request); least_request: fewer
in-flight, then fewer routed so far, then lower index; sticky: none (binding or hash).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from policies.common import healthy, parse_params, tie_key
from policies.registry import register
from policies.snapshot import FORWARD, Decision, Snapshot


@dataclass(frozen=True, slots=True)
class RoundRobin:
    """The ``seq``-th request goes to healthy instance ``seq mod #healthy`` (in index order).

    Score = how many positions after this request's turn an instance comes (0 = chosen).
    """

    name: str = "round_robin"
    type: str = "round_robin"
    reads_prefix_hits: ClassVar[bool] = False
    reads_engine_stats: ClassVar[bool] = False

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        n = len(cands)
        pos = snapshot.request.seq % n
        target = cands[pos].index
        scores = tuple((s.index, float((k - pos) % n)) for k, s in enumerate(cands))
        return Decision(
            FORWARD, target, f"round robin: request #{snapshot.request.seq} -> position {pos} of {n} healthy",
            scores=scores,
        )


@dataclass(frozen=True, slots=True)
class LeastRequest:
    """Load only: the fewest in-flight requests (ties: fewer routed so far, then lower index).
    Ignores the cache entirely."""

    name: str = "least_request"
    type: str = "least_request"
    reads_prefix_hits: ClassVar[bool] = False
    reads_engine_stats: ClassVar[bool] = False

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        best = min(cands, key=lambda s: tie_key(s))
        return Decision(
            FORWARD, best.index, f"least requests: {best.in_flight} in flight on instance {best.index}",
            scores=tuple((s.index, float(s.in_flight)) for s in cands),
        )


def stable_hash(key: str) -> int:
    """A process-independent hash (crc32), unlike Python's salted ``hash``."""
    return zlib.crc32(key.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class Sticky:
    """Session affinity only: a bound session stays on its instance while that instance is healthy;
    a new session (or one whose instance is unhealthy) goes to healthy instance
    ``crc32(session id) mod #healthy``. A request with no session hashes its request id.

    By design it never looks at load, so hot sessions pin whatever instance they hash to.
    Score: 0 for the chosen instance, 1 for the rest.
    """

    name: str = "sticky"
    type: str = "sticky"
    reads_prefix_hits: ClassVar[bool] = False
    reads_engine_stats: ClassVar[bool] = False

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        b = snapshot.binding
        req = snapshot.request
        if b is not None and snapshot.instances[b].healthy:
            target, reason = b, f"sticky: session bound to instance {b}"
        else:
            key = req.session_id if req.session_id is not None else req.request_id
            pos = stable_hash(key) % len(cands)
            target = cands[pos].index
            why = "new session" if b is None else f"bound instance {b} unhealthy"
            reason = f"sticky: {why}, crc32({key!r}) mod {len(cands)} -> instance {target}"
        return Decision(
            FORWARD, target, reason,
            scores=tuple((s.index, 0.0 if s.index == target else 1.0) for s in cands),
        )


@register("round_robin")
def _round_robin(name: str, params: Mapping[str, Any]) -> RoundRobin:
    parse_params("round_robin", params, {})
    return RoundRobin(name=name)


@register("least_request")
def _least_request(name: str, params: Mapping[str, Any]) -> LeastRequest:
    parse_params("least_request", params, {})
    return LeastRequest(name=name)


@register("sticky")
def _sticky(name: str, params: Mapping[str, Any]) -> Sticky:
    parse_params("sticky", params, {})
    return Sticky(name=name)
