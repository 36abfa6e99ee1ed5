"""A circuit breaker per engine: the mechanism that ejects an engine whose requests fail, and
re-admits it only after a request has succeeded again.

Health checks (``GET /health``) see a dead engine, not a wedged one: an engine whose generation
loop is stuck still answers ``/health`` and ``/metrics`` while every request to it waits forever.
The breaker watches the requests themselves. States:

* ``closed``: the engine takes traffic. Each request outcome is reported: a success (the engine
  answered) resets the count; a failure (time-to-first-byte or idle timeout, a broken connection)
  adds one. ``failure_threshold`` consecutive failures open the breaker; a refused or broken
  connection (the engine process is likely gone) counts against ``connect_threshold`` (default 1:
  ejected at once, as the health checks would soon do). A stall (no byte from any of the engine's
  in-flight requests and no progress counter moving for the stall window) opens it at once.
* ``open``: the engine is ejected (the gateway removes it from the policy's healthy set and ends its
  in-flight requests). After ``cooldown`` seconds a probe is due (the gateway also probes at once
  when the engine's health checks recover from failing: a restarted engine).
* ``half_open``: one probe is running (the gateway's health check plus one real request). Success
  closes the breaker (cool-down back to ``cooldown``); failure opens it again with the cool-down
  multiplied by ``backoff``, up to ``max_cooldown``.

Health checks alone never close a breaker: only a probe does. Time comes from the injected
``clock`` (seconds), so the state machine is tested with a fake one and runs in virtual time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from gpuhit.errors import ConfigError

CLOSED = "closed"
HALF_OPEN = "half_open"
OPEN = "open"
STATES = (CLOSED, HALF_OPEN, OPEN)  # gauge value = index: 0 closed, 1 half-open, 2 open

# Failure kinds: a timeout (TTFB or idle), a refused / unreachable connect, a connection that broke
# after the request was sent (mid-stream death, truncated answer), an engine that made no progress
# on any of its requests for the stall window (gateway/http/forward_deadlines.py; opens at once).
TIMEOUT = "timeout"
CONNECT = "connect"
CLOSED_CONN = "closed"
STALL = "stall"
KINDS = (TIMEOUT, CONNECT, CLOSED_CONN, STALL)


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """Thresholds and cool-downs (seconds) of every engine's breaker."""

    failure_threshold: int = 3
    connect_threshold: int = 1
    cooldown: float = 2.0
    max_cooldown: float = 60.0
    backoff: float = 2.0

    def validate(self) -> BreakerPolicy:
        if self.failure_threshold < 1 or self.connect_threshold < 1:
            raise ConfigError(f"breaker thresholds must be >= 1, got failure_threshold={self.failure_threshold}, "
                              f"connect_threshold={self.connect_threshold}")
        if not 0 < self.cooldown <= self.max_cooldown:
            raise ConfigError(f"breaker cool-down must satisfy 0 < cooldown <= max_cooldown, got "
                              f"{self.cooldown} and {self.max_cooldown}")
        if self.backoff < 1:
            raise ConfigError(f"breaker backoff must be >= 1, got {self.backoff}")
        return self


class CircuitBreaker:
    """One engine's breaker. Report outcomes with :meth:`success` / :meth:`failure`; the gateway
    polls :meth:`probe_due`, runs the probe between :meth:`begin_probe` and :meth:`probe_done`.
    Every state change is counted in :attr:`transitions` (``(from, to) -> n``)."""

    __slots__ = ("_clock", "consecutive", "cooldown", "opens", "policy", "probe_at", "probes", "reason", "state",
                 "transitions")

    def __init__(self, policy: BreakerPolicy, clock: Callable[[], float]):
        self.policy = policy
        self._clock = clock
        self.state = CLOSED
        self.consecutive = 0  # failures in a row while closed
        self.cooldown = policy.cooldown  # the next open period
        self.probe_at: float | None = None  # when an open breaker's probe is due
        self.reason: str | None = None  # why it opened (last failure, or the failed probe)
        self.opens = 0
        self.probes = 0
        self.transitions: Counter[tuple[str, str]] = Counter()

    def _to(self, state: str) -> None:
        self.transitions[(self.state, state)] += 1
        self.state = state

    def success(self) -> None:
        """A request got an answer from the engine. Only a closed breaker counts it: an open one is
        closed by its probe, never by a request that was already in flight."""
        if self.state == CLOSED:
            self.consecutive = 0

    def failure(self, kind: str, why: str) -> bool:
        """A request failed (``kind`` in :data:`KINDS`); True when this opened the breaker."""
        if kind not in KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; expected one of {KINDS}")
        if self.state != CLOSED:
            return False
        self.consecutive += 1
        limit = (1 if kind == STALL else self.policy.failure_threshold if kind == TIMEOUT
                 else self.policy.connect_threshold)
        if self.consecutive < limit:
            return False
        self._open(f"{self.consecutive} consecutive failures, last: {why}")
        return True

    def _open(self, reason: str) -> None:
        self._to(OPEN)
        self.opens += 1
        self.reason = reason
        self.consecutive = 0
        self.probe_at = self._clock() + self.cooldown

    def probe_due(self) -> bool:
        """Open, and its cool-down has passed."""
        return self.state == OPEN and self.probe_at is not None and self._clock() >= self.probe_at

    def begin_probe(self) -> None:
        if self.state != OPEN:
            raise ValueError(f"begin_probe on a {self.state} breaker")
        self.probes += 1
        self._to(HALF_OPEN)

    def probe_done(self, ok: bool, why: str = "") -> None:
        """The probe's outcome: close, or open again with a longer cool-down."""
        if self.state != HALF_OPEN:
            raise ValueError(f"probe_done on a {self.state} breaker")
        if ok:
            self._to(CLOSED)
            self.cooldown = self.policy.cooldown
            self.probe_at = None
            self.reason = None
            return
        self.cooldown = min(self.cooldown * self.policy.backoff, self.policy.max_cooldown)
        self._open(f"probe #{self.probes} failed: {why}")

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    def as_dict(self) -> dict[str, object]:
        return {"state": self.state, "consecutive_failures": self.consecutive, "reason": self.reason,
                "opens": self.opens, "probes": self.probes, "cooldown_s": self.cooldown, "probe_at": self.probe_at}
