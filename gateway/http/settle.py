"""Settling a routed request: the one place that ends its router ticket and counts its outcome.

Every routed request ends exactly once, whichever way it ends: the engine's answer relayed
(:meth:`Settler.ok`: the usage the engine reported becomes the realized hit, split into what the
target held and what a KV transfer brought), or a failure (:meth:`Settler.failed`: an engine error,
a timeout, an ejection, a client that left). The ticket releases the router's counters (in-flight,
pending prefill, decode slots) and records realized hits and errors; the metrics count the answer
by endpoint and status, and an engine-side failure by engine and kind. Keeping both here means a
new way for a request to end cannot forget one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engines.base import GenerateResult
from gateway.http.usage import Usage
from gateway.metrics import GatewayMetrics
from gateway.router import Ticket
from policies.snapshot import FORWARD


class Settler:
    """Ends tickets and counts outcomes. ``names``: the engines' names (metric labels);
    ``block_size``: a transfer that left the realized hit a block or more short of the predicted one
    was recomputed; ``clock``: the loop's time (a result's finish time)."""

    def __init__(self, metrics: GatewayMetrics, names: Sequence[str], block_size: int,
                 clock: Callable[[], float]):
        self.metrics = metrics
        self.names = list(names)
        self.block_size = block_size
        self.clock = clock

    def ok(self, endpoint: str, ticket: Ticket, res: GenerateResult, usage: Usage | None, own_hit: int) -> None:
        """A 200 answer relayed whole. ``own_hit``: the target's own prefix hit before a KV-moving
        decision (the rest of the realized hit is what the transfer brought)."""
        m = self.metrics
        name = self.names[ticket.target]
        moved = ticket.action != FORWARD and not ticket.fallback
        if usage is not None:
            res.completion_tokens = usage.completion_tokens
            cached = usage.cached_tokens
            m.succeeded(endpoint, name, cached)
            if moved:
                # The engine reports local and transferred tokens together; split them so the
                # router's transferred-bytes totals count only what the transfer brought.
                res.external_cached_tokens = max(cached - own_hit, 0)
                res.cached_tokens = cached - res.external_cached_tokens
                short = cached + self.block_size <= ticket.predicted_hit_tokens
                m.kv_moves.inc((ticket.action, "recomputed" if short else "transferred"))
            else:
                res.cached_tokens = cached
        else:
            m.succeeded(endpoint, name, None)
            if moved:
                m.kv_moves.inc((ticket.action, "unverified"))
        res.finish_time = self.clock()
        ticket.finish(res)

    def failed(self, ticket: Ticket, why: str, engine_error: str | None = None, endpoint: str | None = None,
               status: int | None = None) -> None:
        """A request that ended without a relayed answer: ``engine_error`` (a kind: connect,
        timeout, ejected, status, midstream) counts it against the target engine; ``status`` counts
        an answer the client got (or, 499, the client leaving) that no error reply counts."""
        ticket.finish(None, why)
        m = self.metrics
        if engine_error is not None:
            m.upstream_errors.inc((self.names[ticket.target], engine_error))
        if status is not None:
            m.requests.inc((endpoint, str(status)))
