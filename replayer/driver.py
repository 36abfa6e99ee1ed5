"""The replay driver: sends a trace's turns to a :class:`Target`, closed loop or open loop.

Closed loop (default, how agents behave): a session's turn k+1 is sent when turn k has finished
plus turn k+1's think time x ``think_time_scale`` (defaults to ``time_scale``), capped at
``max_think_time`` when given; turn 0 is sent at the session's start. The cap exists because real
agent traces mix tool-loop gaps (seconds) with human pauses of hours (WEKA: p50 12 s, max 21 h);
the pauses only stretch a replay's makespan and dilute utilization without exercising routing. Per-turn delay therefore compounds, which is the point of replaying agents
this way. Open loop (for comparison): every turn is sent at ``session start + turn.offset x
time_scale`` whether or not the previous one finished.

Session starts come from :mod:`replayer.arrivals`; sub-agents start beside their parent at their
recorded offset. The driver reads time only from the running loop, so it runs unchanged in virtual
time (:func:`gpuhit.vtime.run`) or live.

Failures: a request that fails (the target returns a record with ``error`` set, or raises) gets its
row with the error, and the session goes on with its next turn after the think time (an agent
would retry or carry on; later turns of a session usually fail the same way and are recorded too).
With ``stop_session_on_error=True`` the session stops at its first failure instead, and every turn it
did not send gets a row with error ``"not sent: ..."``. Either way the replay goes on, and no failed
request is dropped. Turns not sent because a bound (``max_sessions``, ``max_requests``,
``duration``) was reached are *not* failures and get no row. Neither are turns not sent after
the caller's ``stop`` event was set: a replay whose end is a condition (a harness that stops once
what it waits for has happened) ends on that event, not on a wall-clock guess.

Resume: turns listed in ``skip`` (from :class:`replayer.records.RecordWriter`) are not sent again and
take no time; the next turn waits its think time after the previous turn sent in this run, or after
the session's start.
"""

from __future__ import annotations

import asyncio
import math
import sys
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from itertools import islice
from operator import indexOf
from typing import Protocol

from engines.hashing import common_prefix_len
from gpuhit.errors import ConfigError, GpuhitError
from replayer.arrivals import ArrivalConfig, child_offset, children_index, root_start_times, roots
from replayer.records import RequestRecord
from replayer.trace import Session, Trace, Turn


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One turn to send. ``implied_hit_tokens`` is the trace's reuse bound for it (see records)."""

    request_id: str
    session: Session
    turn_index: int
    implied_hit_tokens: int = 0

    @property
    def turn(self) -> Turn:
        return self.session.turns[self.turn_index]

    @property
    def session_id(self) -> str:
        return self.session.session_id


class Target(Protocol):
    """Where turns go: the simulated gateway+engines, or a live gateway over HTTP.

    ``submit`` returns when the request has finished or failed, with a record holding at least
    instance/action/reason, the times, token counts and hits; the driver fills the identity columns
    (run, session, turn, implied hits). Request failures should come back as ``record.error``.
    """

    async def submit(self, req: TurnRequest) -> RequestRecord: ...


@dataclass(frozen=True, slots=True)
class DriverConfig:
    arrival: ArrivalConfig = field(default_factory=ArrivalConfig)
    open_loop: bool = False
    think_time_scale: float | None = None  # None = arrival.time_scale
    max_think_time: float | None = None  # cap on each (scaled) think time, seconds; None = no cap
    max_sessions: int | None = None  # root sessions started (their sub-agents come along)
    max_requests: int | None = None  # requests sent
    duration: float | None = None  # seconds of replay clock after which nothing new is sent
    stop_session_on_error: bool = False
    run_id: str = ""
    policy: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_requests"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be positive, got {v}")
        if self.duration is not None and not self.duration > 0:
            raise ConfigError(f"duration must be positive, got {self.duration}")
        if self.max_think_time is not None and not self.max_think_time >= 0:
            raise ConfigError(f"max_think_time must be >= 0, got {self.max_think_time}")
        if self.think_time_scale is not None and not (self.think_time_scale >= 0 and math.isfinite(self.think_time_scale)):
            raise ConfigError(f"think_time_scale must be finite and >= 0, got {self.think_time_scale}")


@dataclass(slots=True)
class ReplayOutcome:
    records: list[RequestRecord]
    start: float  # replay clock at the start
    end: float  # replay clock when the last request finished
    sessions_started: int
    requests_sent: int
    requests_total: int  # turns the replay would send without bounds (for progress/ETA)

    @property
    def makespan(self) -> float:
        return self.end - self.start


def count_requests(trace: Trace, max_sessions: int | None = None) -> int:
    """Turns a replay of ``trace`` sends (the root sessions kept by ``max_sessions`` and their sub-agents)."""
    kids = children_index(trace)
    total = 0
    stack = list(roots(trace)[:max_sessions] if max_sessions else roots(trace))
    while stack:
        s = stack.pop()
        total += len(s.turns)
        stack.extend(kids.get(s.session_id, ()))
    return total


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Replay:
    def __init__(self, trace: Trace, target: Target, cfg: DriverConfig,
                 sink: Callable[[RequestRecord], None] | None, skip: Collection[tuple[str, int]],
                 on_record: Callable[[RequestRecord], None] | None, stop: asyncio.Event | None = None):
        self.trace = trace
        self.stop = stop
        self.target = target
        self.cfg = cfg
        self.sink = sink
        self.skip = skip
        self.on_record = on_record
        self.kids = children_index(trace)
        self.scale = cfg.arrival.time_scale
        self.think_scale = cfg.think_time_scale if cfg.think_time_scale is not None else self.scale
        self.max_think = cfg.max_think_time if cfg.max_think_time is not None else math.inf
        self.records: list[RequestRecord] = []
        self.seen: dict[str, set[int]] = {}  # namespace -> trace hash ids sent so far
        self._last_ids: dict[str, tuple[int, ...]] = {}  # namespace -> the last turn's ids _implied checked
        self.sent = 0
        self.sessions_started = 0
        self.loop = asyncio.get_running_loop()
        self.t0 = self.loop.time()
        self.deadline = self.t0 + cfg.duration if cfg.duration is not None else math.inf
        self.last_finish = self.t0
        self._reported: set[str] = set()
        # Set once nothing more may be sent (request budget spent, or the duration is over), so
        # sessions waiting for their start or a think time stop at once instead of sleeping on:
        # in live mode a trace's later arrivals would otherwise hold the replay for its whole span.
        self._stopped = False
        self._sleeping: set[asyncio.Future[None]] = set()  # the pauses in progress (_halt ends them)
        self._deadline_timer = (
            self.loop.call_at(self.deadline, self._halt) if math.isfinite(self.deadline) else None
        )

    # -- bounds ---------------------------------------------------------------------------------
    def _may_send(self) -> bool:
        if self._stopped:
            return False
        if self.cfg.max_requests is not None and self.sent >= self.cfg.max_requests:
            return False
        return self.loop.time() <= self.deadline

    # -- implied reuse --------------------------------------------------------------------------
    def _implied(self, s: Session, turn: Turn) -> int:
        """Longest prefix of this turn's trace blocks already sent in its namespace, in tokens."""
        seen = self.seen.setdefault(s.namespace, set())
        ids = turn.hash_ids
        # Every id of the namespace's last checked turn is in ``seen`` by now, so the ids this turn
        # shares with it from the front are seen too: only the ones after them are probed (a turn
        # extends its session's previous one, so that is the new part of a long prompt).
        last = self._last_ids.get(s.namespace)
        start = common_prefix_len(ids, last) if last else 0
        self._last_ids[s.namespace] = ids
        # C-level passes, not a Python loop: prompts run to thousands of trace blocks. indexOf stops
        # at the first unseen id without building a list, and only the ids from there on can be new.
        try:
            n = start + indexOf(map(seen.__contains__, islice(ids, start, None)), False)
        except ValueError:  # every id seen: nothing to add
            return min(len(ids) * s.block_size, turn.input_length)
        seen.update(islice(ids, n, None))
        return min(n * s.block_size, turn.input_length)

    # -- one request ----------------------------------------------------------------------------
    def _emit(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        if self.sink is not None:
            self.sink(rec)
        if self.on_record is not None:
            self.on_record(rec)

    def _stamp(self, rec: RequestRecord, s: Session, k: int, implied: int) -> RequestRecord:
        rec.run_id = self.cfg.run_id
        rec.policy = self.cfg.policy
        rec.seed = self.cfg.seed
        rec.session = s.session_id
        rec.parent_session = s.parent or ""
        rec.turn = k
        rec.implied_hit_tokens = implied
        return rec

    async def _send(self, s: Session, k: int) -> bool:
        """Send turn k of s; returns whether it succeeded."""
        turn = s.turns[k]
        implied = self._implied(s, turn)
        req = TurnRequest(f"{s.session_id}#{k}", s, k, implied)
        self.sent += 1
        if self.cfg.max_requests is not None and self.sent >= self.cfg.max_requests:
            self._halt()
        sent_at = self.loop.time()
        try:
            rec = await self.target.submit(req)
        except Exception as exc:  # noqa: BLE001 - recorded, never dropped (module docstring)
            rec = RequestRecord(arrival=sent_at, finish=self.loop.time(), input_tokens=turn.input_length,
                                error=f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, GpuhitError) and type(exc).__name__ not in self._reported:
                # An unexpected exception is probably a bug: show its traceback once per type.
                self._reported.add(type(exc).__name__)
                print(f"gpuhit replay: request {req.request_id} raised:", file=sys.stderr)
                traceback.print_exception(exc, file=sys.stderr)
        if math.isnan(rec.arrival):
            rec.arrival = sent_at
        if not math.isnan(rec.finish):
            self.last_finish = max(self.last_finish, rec.finish)
        else:
            self.last_finish = max(self.last_finish, self.loop.time())
        self._emit(self._stamp(rec, s, k, implied))
        return rec.ok

    def _not_sent(self, s: Session, k: int, why: str) -> None:
        turn = s.turns[k]
        rec = RequestRecord(input_tokens=turn.input_length, error=f"not sent: {why}")
        self._emit(self._stamp(rec, s, k, 0))

    # -- sessions -------------------------------------------------------------------------------
    def _halt(self) -> None:
        """Nothing more may be sent: mark it and end every pause now."""
        self._stopped = True
        for fut in self._sleeping:
            _wake(fut)

    async def _pause(self, delay: float) -> None:
        """Sleep ``delay`` seconds of replay clock, or less if the replay stops sending meanwhile.

        One future and one timer (which :meth:`_halt` may beat): every session pauses before each
        turn, and ``asyncio.wait_for`` on the stop event made a task, a waiter and a cancellation
        per pause, about three times the CPU.
        """
        if delay <= 0 or self._stopped:
            return
        fut = self.loop.create_future()
        timer = self.loop.call_later(delay, _wake, fut)
        self._sleeping.add(fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._sleeping.discard(fut)

    async def _sleep_until(self, t: float) -> None:
        await self._pause(t - self.loop.time())

    async def _session(self, s: Session) -> None:
        start = self.loop.time()
        child_tasks = [
            asyncio.ensure_future(self._session_at(
                c, start + child_offset(c, s, self.scale, self.cfg.think_time_scale, self.cfg.max_think_time)))
            for c in self.kids.get(s.session_id, ())
        ]
        try:
            if self.cfg.open_loop:
                await self._turns_open(s, start)
            else:
                await self._turns_closed(s)
        finally:
            if child_tasks:
                await asyncio.gather(*child_tasks)

    async def _session_at(self, s: Session, t: float) -> None:
        await self._sleep_until(t)
        if self.loop.time() > self.deadline:
            return
        await self._session(s)

    async def _turns_closed(self, s: Session) -> None:
        for k, turn in enumerate(s.turns):
            if (s.session_id, k) in self.skip:
                self.seen.setdefault(s.namespace, set()).update(turn.hash_ids)
                continue
            if k > 0 and turn.think_time > 0:
                await self._pause(min(turn.think_time * self.think_scale, self.max_think))
            if not self._may_send():
                return
            ok = await self._send(s, k)
            if not ok and self.cfg.stop_session_on_error:
                for j in range(k + 1, len(s.turns)):
                    if (s.session_id, j) not in self.skip:
                        self._not_sent(s, j, f"session stopped after turn {k} failed")
                return

    async def _turns_open(self, s: Session, start: float) -> None:
        async def one(k: int, turn: Turn) -> None:
            await self._sleep_until(start + turn.offset * self.scale)
            if self._may_send():
                await self._send(s, k)

        tasks = []
        for k, turn in enumerate(s.turns):
            if (s.session_id, k) in self.skip:
                self.seen.setdefault(s.namespace, set()).update(turn.hash_ids)
                continue
            tasks.append(one(k, turn))
        await asyncio.gather(*tasks)

    async def _halt_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._halt()

    async def run(self) -> ReplayOutcome:
        watcher = self.loop.create_task(self._halt_on(self.stop)) if self.stop is not None else None
        try:
            return await self._run()
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _run(self) -> ReplayOutcome:
        rs = roots(self.trace)
        if self.cfg.max_sessions is not None:
            rs = rs[: self.cfg.max_sessions]
        cfg = self.cfg.arrival
        starts = root_start_times(rs, cfg)
        if starts is None:  # fixed population
            it = iter(rs)

            async def worker() -> None:
                for s in it:
                    if not self._may_send():
                        return
                    self.sessions_started += 1
                    await self._session(s)

            await asyncio.gather(*(worker() for _ in range(int(cfg.sessions_concurrent or 1))))
        else:

            async def at(s: Session, t: float) -> None:
                await self._sleep_until(self.t0 + t)
                if not self._may_send():
                    return
                self.sessions_started += 1
                await self._session(s)

            await asyncio.gather(*(at(s, t) for s, t in zip(rs, starts)))
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        total = count_requests(self.trace, self.cfg.max_sessions)
        return ReplayOutcome(self.records, self.t0, self.last_finish, self.sessions_started, self.sent, total)


async def replay(trace: Trace, target: Target, cfg: DriverConfig | None = None, *,
                 sink: Callable[[RequestRecord], None] | None = None,
                 skip: Collection[tuple[str, int]] = frozenset(),
                 on_record: Callable[[RequestRecord], None] | None = None,
                 stop: asyncio.Event | None = None) -> ReplayOutcome:
    """Replay ``trace`` against ``target`` on the running loop; returns every record made.

    ``sink`` receives each record as it is made (e.g. ``RecordWriter.write``); ``skip`` lists
    ``(session, turn)`` pairs already done (resume); ``on_record`` is a progress hook. Once
    ``stop`` is set nothing new is sent (as when ``duration`` is over): the requests in flight
    finish and get their rows, and the replay returns.
    """
    return await _Replay(trace, target, cfg or DriverConfig(), sink, skip, on_record, stop).run()
