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


class SessionResidency:
    """Session -> (instance, context blocks, in-flight count, last finish) and the live window."""

    __slots__ = ("_gaps", "_idle_since", "_n_gaps", "_sessions", "_started", "window_s")

    def __init__(self) -> None:
        # session -> [instance, blocks, in_flight, idle_since (None while in flight)]
        self._sessions: dict[str, list] = {}
        self._started: dict[str, float] = {}
        # session -> when its last turn finished with none in flight (kept apart from _sessions,
        # which forgets sessions idle beyond the window: their gaps must still be observed)
        self._idle_since: dict[str, float] = {}
        self._gaps: deque[float] = deque(maxlen=_GAPS_KEPT)
        self._n_gaps = 0
        self.window_s = 0.0

    def started_at(self, session: str | None) -> float | None:
        """When the gateway first saw ``session`` (None: never, or no session id)."""
        return None if session is None else self._started.get(session)

    def on_arrival(self, session: str | None, now: float) -> None:
        """A request of ``session`` arrived (before routing): stamp its start, observe its think gap."""
        if session is None:
            return
        self._started.setdefault(session, now)
        idle_since = self._idle_since.pop(session, None)
        if idle_since is not None:
            self._observe_gap(now - idle_since)

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
        e = self._sessions.get(session) if session is not None else None
        if e is None:
            return
        e[2] = max(0, e[2] - 1)
        if e[2] == 0:
            e[3] = now
            self._idle_since[session] = now

    def _observe_gap(self, gap: float) -> None:
        self._gaps.append(max(0.0, gap))
        self._n_gaps += 1
        if self._n_gaps % _REFRESH == 1:  # the first gap, then every _REFRESH-th
            g = sorted(self._gaps)
            self.window_s = g[min(len(g) - 1, int(LIVE_QUANTILE * len(g)))]

    def resident_blocks(self, n: int, now: float, exclude: str | None) -> list[int]:
        """Per instance, the context blocks of live sessions other than ``exclude`` (forgets the
        sessions idle beyond the live window)."""
        out = [0] * n
        dead = []
        w = self.window_s
        for sid, (inst, blocks, inflight, idle_since) in self._sessions.items():
            if inflight == 0 and idle_since is not None and now - idle_since > w:
                dead.append(sid)
                continue
            if sid != exclude and 0 <= inst < n:
                out[inst] += blocks
        for sid in dead:
            del self._sessions[sid]
        return out

    def live_sessions(self) -> int:
        """Sessions currently tracked (debug)."""
        return len(self._sessions)

