"""Per-session HBM working set, as the gateway can know it from its own routing.

Mutable knowledge kept out of the policies (they see :attr:`InstanceState.resident_blocks` and
:attr:`Snapshot.session_started_at`). The router feeds it from what it carries out:

* :meth:`SessionResidency.on_routed`: a FORWARD or MIGRATE puts the session's context (prompt +
  output blocks of this turn) on the target instance; the session is now *active* there.
* :meth:`SessionResidency.on_finished`: the turn ended; the session is *idle* (thinking, or running
  a tool) from now on, and the gap until its next turn is one observation of think time.

A session counts toward its instance's working set while a request of it is in flight, or while
it has been idle for less than the **live window**: the 90th percentile of the think gaps the
gateway has observed so far (time from a turn's finish to the next turn of the same session). No
parameter: the window is derived from the traffic itself, and it is 0 (only in-flight sessions
count) until the first gap has been seen. A session idle longer than the window is forgotten: if
it comes back, its KV was probably evicted anyway (LRU), and it counts again from its next turn.

Two more observations feed the adaptive policy (``policies/adaptive.py``), both running totals of
the same routing history:

* **Return rates.** Of the turns after which a session went idle, the share whose session sent
  another turn: one rate after a session's first turn, one after later turns (agentic traces:
  nearly every turn is followed by another; chat traces such as Mooncake's: most sessions are a
  single turn). :meth:`SessionResidency.expected_resident_blocks` weights an idle live session's
  context by its rate, so a working set counts what is likely to come back, not every session that
  ended recently. The rate is ``(returns + 1) / (finishes + 1)`` (Laplace's rule of succession: 1,
  every idle session counted as :meth:`resident_blocks` counts them, before any finish); a finish
  whose return is still to come counts as a non-return, which biases the rate low by at most the
  sessions idle right now.
* **Service time.** The median and the 90th percentile, over the most recent finished turns, of
  the time from a turn's arrival at the gateway to its finish (:attr:`SessionResidency.service_s`,
  :attr:`SessionResidency.service_p90_s`): the observed time a request takes here, queueing
  included, the scale of the priority's aging.

* **Prefill work.** The median, over the most recent routed requests, of the prefill each was sent
  to do (:attr:`SessionResidency.prefill_work_median`, in the unit of ``policies/costmodel.py``'s
  ``prefill_work_tokens``: the uncached tokens plus their attention term): the size of the prefill
  the next request most likely brings, wherever it is placed. The median, not the mean: prompt
  sizes are heavy-tailed (the Mooncake trace: a tenth over 32k tokens), and a mean pulled up by the
  tail calls most prefills "small".

Everything here is routing history (session ids, prompt lengths, finish times), which a real
gateway in front of vLLM has; nothing reads engine internals.
"""

from __future__ import annotations

from collections import deque

# Think gaps kept for the live window's percentile (the most recent ones): enough for a stable p90,
# few enough that re-sorting them every ``_REFRESH`` observations stays cheap.
_GAPS_KEPT = 512
_REFRESH = 32
LIVE_QUANTILE = 0.9
_SERVICE_KEPT = 512  # finished turns whose service time the median is taken over (and routed prefills)


class _Recent:
    """The most recent ``kept`` observations, and a sorted copy refreshed at the first observation and
    every ``_REFRESH``-th after (sorting at every one would cost a sort per request)."""

    __slots__ = ("_kept", "_n", "_sorted")

    def __init__(self, kept: int) -> None:
        self._kept: deque = deque(maxlen=kept)
        self._n = 0
        self._sorted: list = []

    def add(self, x: float) -> bool:
        """Observe ``x``; True when the sorted copy was refreshed (its quantiles may have moved)."""
        self._kept.append(x)
        self._n += 1
        if self._n % _REFRESH != 1:
            return False
        self._sorted = sorted(self._kept)
        return True

    def quantile(self, q: float):
        """The ``q`` quantile of the sorted copy (lower element; call after a refresh)."""
        g = self._sorted
        return g[min(len(g) - 1, int(q * len(g)))]


class SessionResidency:
    """Session -> (instance, context blocks, in-flight count, last finish) and the live window."""

    __slots__ = ("_arrived", "_finishes", "_gaps", "_idle_since", "_returns", "_service", "_sessions", "_started",
                 "_turns", "_work", "prefill_work_median", "service_p90_s", "service_s", "window_s")

    def __init__(self) -> None:
        # session -> [instance, blocks, in_flight, idle_since (None while in flight)]
        self._sessions: dict[str, list] = {}
        self._started: dict[str, float] = {}
        # session -> when its last turn finished with none in flight (kept apart from _sessions,
        # which forgets sessions idle beyond the window: their gaps must still be observed)
        self._idle_since: dict[str, float] = {}
        self._gaps = _Recent(_GAPS_KEPT)
        self.window_s = 0.0
        # Return rates (module docstring): per bucket (0: after a session's first turn, 1: after a
        # later one), turns after which the session went idle, and those followed by another turn.
        self._turns: dict[str, int] = {}  # session -> turns arrived so far
        self._finishes = [0, 0]
        self._returns = [0, 0]
        # Service time: session -> arrival of its turn in flight; recent service times; their median.
        self._arrived: dict[str, float] = {}
        self._service = _Recent(_SERVICE_KEPT)
        self.service_s: float | None = None
        self.service_p90_s: float | None = None
        # Prefill work of the most recent routed requests, and their median.
        self._work = _Recent(_SERVICE_KEPT)
        self.prefill_work_median: int | None = None

    def started_at(self, session: str | None) -> float | None:
        """When the gateway first saw ``session`` (None: never, or no session id)."""
        return None if session is None else self._started.get(session)

    def on_arrival(self, session: str | None, now: float) -> None:
        """A request of ``session`` arrived (before routing): stamp its start, observe its think gap."""
        if session is None:
            return
        self._started.setdefault(session, now)
        turns = self._turns.get(session, 0)
        self._turns[session] = turns + 1
        self._arrived[session] = now
        idle_since = self._idle_since.pop(session, None)
        if idle_since is not None:
            self._observe_gap(now - idle_since)
            self._returns[0 if turns <= 1 else 1] += 1

    def on_routed(self, session: str | None, instance: int, blocks: int) -> None:
        """The session's context (``blocks`` KV blocks after this turn) now lives on ``instance``."""
        if session is None:
            return
        e = self._sessions.get(session)
        if e is None or e[0] != instance:
            inflight = e[2] if e is not None else 0
            self._sessions[session] = [instance, blocks, inflight + 1, None]
        else:
            e[1] = max(e[1], blocks)
            e[2] += 1
            e[3] = None

    def on_finished(self, session: str | None, instance: int, now: float) -> None:
        """A turn of ``session`` on ``instance`` ended (ok or not)."""
        if session is None:
            return
        arrived = self._arrived.pop(session, None)
        if arrived is not None:
            self._observe_service(now - arrived)
        e = self._sessions.get(session)
        if e is None:
            return
        e[2] = max(0, e[2] - 1)
        if e[2] == 0:
            e[3] = now
            self._idle_since[session] = now
            self._finishes[0 if self._turns.get(session, 1) <= 1 else 1] += 1

    def on_prefill_routed(self, work: int) -> None:
        """A request was routed with ``work`` of prefill to do (its target's, plus its producer
        step's for a KV-moving action), in prefill-work tokens."""
        if self._work.add(work):
            self.prefill_work_median = self._work.quantile(0.5)

    def return_rate(self, after_first_turn: bool) -> float:
        """The observed share of idle sessions that sent another turn, after their first turn or
        after a later one (module docstring)."""
        b = 0 if after_first_turn else 1
        # Laplace's rule of succession: 1 before any finish, no jump to 0 on the first one
        return min(1.0, (self._returns[b] + 1) / (self._finishes[b] + 1))

    def _observe_service(self, seconds: float) -> None:
        if self._service.add(max(0.0, seconds)):
            self.service_s = self._service.quantile(0.5)
            self.service_p90_s = self._service.quantile(0.9)

    def _observe_gap(self, gap: float) -> None:
        if self._gaps.add(max(0.0, gap)):
            self.window_s = self._gaps.quantile(LIVE_QUANTILE)

    def resident_blocks(self, n: int, now: float, exclude: str | None) -> list[int]:
        """Per instance, the context blocks of live sessions other than ``exclude`` (forgets the
        sessions idle beyond the live window)."""
        return self.working_sets(n, now, exclude)[0]

    def expected_resident_blocks(self, n: int, now: float, exclude: str | None) -> list[int]:
        """Per instance, the context blocks of the live sessions other than ``exclude``, each idle
        one weighted by its bucket's :meth:`return_rate` (in-flight ones count in full)."""
        return self.working_sets(n, now, exclude)[1]

    def working_sets(self, n: int, now: float, exclude: str | None) -> tuple[list[int], list[int]]:
        """Both per-instance sums, :meth:`resident_blocks` and :meth:`expected_resident_blocks`, in
        one pass over the live sessions (forgetting those idle beyond the live window)."""
        rate = (self.return_rate(True), self.return_rate(False))
        turns = self._turns
        live = [0] * n
        expected = [0.0] * n
        dead = []
        w = self.window_s
        for sid, (inst, blocks, inflight, idle_since) in self._sessions.items():
            if inflight == 0 and idle_since is not None and now - idle_since > w:
                dead.append(sid)
                continue
            if sid != exclude and 0 <= inst < n:
                live[inst] += blocks
                expected[inst] += blocks if inflight else blocks * rate[0 if turns.get(sid, 1) <= 1 else 1]
        for sid in dead:
            del self._sessions[sid]
        return live, [round(x) for x in expected]

    def live_sessions(self) -> int:
        """Sessions currently tracked (debug)."""
        return len(self._sessions)

