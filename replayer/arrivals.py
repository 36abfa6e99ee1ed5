"""When sessions start: the schedule of a replay's root sessions, and of their sub-agents.

Three modes for *root* sessions (sessions without a parent):

- ``"trace"``: at the trace's recorded arrival (relative to the earliest root), times ``time_scale``.
  Traces whose conversations all start at t=0 (WEKA) then start every session at once.
- ``"poisson"``: a Poisson process at ``session_rate`` sessions/s, drawn from a seeded
  ``numpy.random.Generator``: the first root starts at 0, the gaps are exponential. Roots are
  taken in trace order (by recorded arrival, ties by position), so the same seed gives the same
  schedule.
- ``"concurrent"``: a fixed population of ``sessions_concurrent`` sessions; the first N roots start
  at 0 and each time a root session *family* (the root and all its sub-agents) ends, the next root
  starts. That schedule depends on completions, so the driver realises it (see
  :func:`replayer.driver.replay`); :func:`root_start_times` returns ``None`` for it.

Sub-agents (child sessions) always start at ``parent start + (child.arrival - parent.arrival) x
time_scale``, concurrently with the parent's own turns, whatever the mode. When think times are
scaled differently or capped, the child's recorded offset is mapped through the same transform
(:func:`replay_offset`), so the child stays next to the parent turn that spawned it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuhit.errors import ConfigError
from replayer.trace import Session, Trace

MODES = ("trace", "poisson", "concurrent")


@dataclass(frozen=True, slots=True)
class ArrivalConfig:
    mode: str = "trace"
    session_rate: float | None = None  # sessions/s, poisson only
    sessions_concurrent: int | None = None  # population, concurrent only
    time_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown arrival mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not (self.time_scale >= 0 and np.isfinite(self.time_scale)):
            raise ConfigError(f"time_scale must be a finite number >= 0, got {self.time_scale}")
        if self.mode == "poisson" and not (self.session_rate and self.session_rate > 0):
            raise ConfigError("poisson arrivals need --session-rate > 0 (sessions per second)")
        if self.mode == "concurrent" and not (self.sessions_concurrent and self.sessions_concurrent > 0):
            raise ConfigError("concurrent arrivals need --sessions-concurrent N > 0")


def roots(trace: Trace) -> list[Session]:
    """Root sessions in replay order: by recorded arrival, ties by position in the trace."""
    idx = [(s.arrival, i, s) for i, s in enumerate(trace.sessions) if s.parent is None]
    idx.sort(key=lambda t: (t[0], t[1]))
    return [s for _, _, s in idx]


def children_index(trace: Trace) -> dict[str, list[Session]]:
    """parent session id -> its direct children, by recorded arrival. Unknown parents raise."""
    ids = {s.session_id for s in trace.sessions}
    out: dict[str, list[Session]] = {}
    for s in trace.sessions:
        if s.parent is not None:
            if s.parent not in ids:
                raise ConfigError(f"session {s.session_id!r} names unknown parent {s.parent!r}")
            out.setdefault(s.parent, []).append(s)
    for kids in out.values():
        kids.sort(key=lambda s: s.arrival)
    return out


def replay_offset(session: Session, offset: float, time_scale: float = 1.0, think_time_scale: float | None = None,
                  max_think_time: float | None = None) -> float:
    """Map a point ``offset`` seconds into ``session``'s *recorded* timeline onto the replay's.

    The recorded timeline alternates service (a turn's recorded send to the next turn's send minus
    that turn's think time) and think time. The replay scales service by ``time_scale`` and think
    time by ``think_time_scale`` (default ``time_scale``), capped at ``max_think_time``: the same
    transform the closed-loop driver applies. With no cap and equal scales this is simply
    ``offset x time_scale``. Used to place sub-agents (so a think-time cap shortens the parent's
    timeline and its children's starts alike) and for the trace's own span.
    """
    ts = time_scale if think_time_scale is None else think_time_scale
    cap = math.inf if max_think_time is None else max_think_time
    if offset <= 0:
        return 0.0
    if ts == time_scale and cap == math.inf:
        return offset * time_scale
    turns = session.turns
    if not turns or offset <= turns[0].offset:
        return offset * time_scale
    t = turns[0].offset * time_scale
    j = 0
    for k in range(1, len(turns)):
        if turns[k].offset > offset:
            break
        think = turns[k].think_time
        service = max(0.0, (turns[k].offset - turns[k - 1].offset) - think)
        t += service * time_scale + min(think * ts, cap)
        j = k
    rem = offset - turns[j].offset
    if rem > 0:
        if j + 1 < len(turns):
            service_j = max(0.0, turns[j + 1].offset - turns[j].offset - turns[j + 1].think_time)
        else:
            # After the last turn nothing says how long it ran: treat the rest as a pause (capped),
            # or a sub-agent recorded hours after its parent's last turn would start hours late.
            service_j = 0.0
        t += min(rem, service_j) * time_scale + min(max(0.0, rem - service_j) * ts, cap)
    return t


def child_offset(child: Session, parent: Session, time_scale: float, think_time_scale: float | None = None,
                 max_think_time: float | None = None) -> float:
    """Seconds after the parent's start at which ``child`` starts (never negative): the child's
    recorded offset in the parent, mapped by :func:`replay_offset`."""
    return replay_offset(parent, child.arrival - parent.arrival, time_scale, think_time_scale, max_think_time)


def root_start_times(root_sessions: Sequence[Session], cfg: ArrivalConfig) -> list[float] | None:
    """Start time (seconds from replay start) of each root, in order; None for ``concurrent``."""
    if cfg.mode == "concurrent":
        return None
    if not root_sessions:
        return []
    if cfg.mode == "trace":
        t0 = min(s.arrival for s in root_sessions)
        return [(s.arrival - t0) * cfg.time_scale for s in root_sessions]
    rng = np.random.default_rng(cfg.seed)
    gaps = rng.exponential(1.0 / float(cfg.session_rate), size=len(root_sessions))  # type: ignore[arg-type]
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
