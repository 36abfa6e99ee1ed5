"""Deadlines of the gateway's upstream exchanges: a time-to-first-byte limit, then an idle limit
between chunks (instead of one cap on a whole stream, which would cut a long generation), and an
abort for the exchanges of an engine whose circuit breaker opened. Used by
:mod:`gateway.http.forward`; one timer per gateway checks them all (no timer per request).

The same timer watches each engine as a whole: one that has streamed requests in flight and for
``stall`` seconds sent no byte for any request, and whose scraped progress counters did not move
(:data:`engines.vllm.metrics_scrape.PROGRESS`: a long non-streamed answer still moves them), is
stalled (a stuck generation loop, a SIGSTOPped process), whatever each request's own budget;
``on_stall`` gets it (the breakers eject it). One request's TTFB budget must cover a long queue
and a long prefill; an engine where nothing at all moves has no such excuse. The first sign comes
sooner: after a fifth of the window without progress ``on_suspect(i, True)`` (new requests go to
other engines meanwhile), and ``on_suspect(i, False)`` once it moves again or has nothing in flight.

Every limit is judged as of the previous sweep, not the current one. Between two sweeps the loop
has polled its sockets and run the tasks they woke, so a byte that came before the previous sweep
is in ``last`` by now; at the current sweep that is not so after the loop itself was held up (a
starved process, a long synchronous step): the bytes that came meanwhile still wait in the socket
(uvloop even runs due timers before it polls), and judging "now" would blame the engine for the
gateway's own blindness, cutting healthy streams and ejecting a healthy engine. A limit therefore
fires between one and two ticks after it passed, and never for silence the gateway did not watch.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

TTFB = "ttfb"
IDLE = "idle"
EJECTED = "ejected"


class Watchdog:
    """Deadlines of one upstream exchange: ``first`` seconds to the first answer byte, then
    ``idle`` seconds between chunks (0 = no limit), measured on the loop's clock while the gateway
    waits for the engine (time spent writing to the client is not the engine's: the caller sets
    :attr:`last` to None around a write). :class:`Deadlines` checks every active watchdog on one
    timer; when a deadline has passed, or :meth:`abort` is called (the engine's breaker opened),
    the task that made it (:meth:`Deadlines.enter`) is cancelled, :meth:`leave` answers True for
    that cancellation (the caller turns it into its 504 / 502) and :attr:`fired` says which
    (``ttfb``, ``idle``, ``ejected``). Plain calls, not an ``async with``: entering and leaving
    cost a set insertion and removal, no coroutine; per chunk: one ``loop.time()``. A slots class,
    not a msgspec Struct: a stream stores :attr:`last` twice a chunk, and an attribute store on a
    Struct takes the generic path (about twice a slot's)."""

    __slots__ = ("_cancelling", "_deadlines", "_instance", "_listed", "_task", "after", "fired", "first", "idle",
                 "last", "limit", "streamed", "why")

    def __init__(self, deadlines: Deadlines, instance: int, first: float, idle: float, task: asyncio.Task,
                 streamed: bool = True):
        self._deadlines = deadlines
        self.streamed = streamed  # bytes come per token (the stall check waits on these only)
        self._instance = instance
        self.limit = first or None  # the limit now: None once done (or when there is none)
        self.idle = idle or None
        self._task: asyncio.Task | None = task
        self._cancelling = task.cancelling()
        self.last: float | None = deadlines.loop.time()
        self.first = True  # no answer byte yet: ``limit`` is the TTFB one
        self.fired: str | None = None
        self.after = 0.0  # the limit (seconds) that fired
        self.why = ""
        # In its engine's set (Deadlines.enter adds it): an exchange that ends is done() and then
        # leave()s, and only the first takes it out (a call fewer per request).
        self._listed = True

    def leave(self, cancelled: bool) -> bool:
        """The exchange is over (``cancelled``: it ended in ``CancelledError``). True when that
        cancellation was this watchdog's own (a deadline or an ejection, not the client leaving
        or a whole-request timeout): the caller answers with the error of :attr:`fired`
        instead of propagating it. As ``asyncio.timeout`` does, the watchdog's cancel request is
        withdrawn (``uncancel``) once it fired, whether or not it reached the task."""
        self.limit = None
        if self._listed:
            self._deadlines.discard(self._instance, self)
        task, self._task = self._task, None
        assert task is not None, "leave() called twice"
        return self.fired is not None and task.uncancel() <= self._cancelling and cancelled

    def first_byte(self) -> None:
        """The engine's first byte came: from now on the idle limit applies."""
        self.first = False
        self.limit = self.idle

    def done(self) -> None:
        """Nothing more to wait for from the engine: no deadline, no abort."""
        self.limit = None
        if self._listed:
            self._deadlines.discard(self._instance, self)

    def check(self, seen: float) -> None:
        """Fire if the current deadline had passed at ``seen`` (called by :class:`Deadlines` with
        the previous sweep's time: see the module docstring)."""
        limit = self.limit
        last = self.last
        if limit is None or last is None or seen - last < limit or self.fired is not None:
            return
        self.fired = TTFB if self.first else IDLE
        self.after = limit
        self._cancel()

    def abort(self, why: str) -> None:
        """End the exchange now (its engine was ejected)."""
        if self.fired is not None:
            return
        self.fired = EJECTED
        self.why = why
        self._cancel()

    def _cancel(self) -> None:
        if self._listed:
            self._deadlines.discard(self._instance, self)
        if self._task is not None:
            self._task.cancel()


class Deadlines:
    """Every in-flight upstream exchange's :class:`Watchdog`, by engine, checked on one loop timer
    every ``tick`` seconds while any is active, as of the previous check (a deadline fires one to
    two ticks late: the tick is a twentieth of the shortest limit, within [10 ms, 1 s]).
    :meth:`abort` ends an engine's exchanges at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, n: int, ttfb: float, idle: float, stall: float = 0.0,
                 on_stall: Callable[[int, str], None] | None = None,
                 counters_at: Callable[[int], float | None] | None = None,
                 on_suspect: Callable[[int, bool], None] | None = None):
        self.loop = loop
        self.in_flight: list[set[Watchdog]] = [set() for _ in range(n)]
        self.stall = stall if on_stall is not None else 0.0
        self._on_stall = on_stall
        self._counters_at = counters_at  # when engine i's progress counters last moved (scrapes)
        # Loop time of engine i's last answer byte (or of its first request in flight after none).
        self.progress_at: list[float] = [-math.inf] * n
        self.streams = [0] * n  # streamed exchanges in flight, by engine
        self._on_suspect = on_suspect
        self.suspect_after = self.stall / 5
        self.suspected = [False] * n
        limits = [x for x in (ttfb, idle, self.suspect_after) if x > 0]
        self.tick = min(max(min(limits) / 20, 0.01), 1.0) if limits else None
        self._active = 0
        self._timer: asyncio.TimerHandle | None = None
        self._seen = -math.inf  # loop time of the previous sweep (or of arming the timer): what is judged

    def enter(self, i: int, first: float, idle: float, streamed: bool = True) -> Watchdog:
        """A watchdog over the current task's exchange with engine ``i``, active from now until its
        :meth:`Watchdog.leave` (or :meth:`Watchdog.done`); ``streamed``: its answer comes token by
        token."""
        task = asyncio.current_task(self.loop)
        assert task is not None, "Deadlines.enter() outside a task"
        wd = Watchdog(self, i, first, idle, task, streamed)
        if streamed:
            if not self.streams[i]:
                self.progress_at[i] = wd.last  # nothing was owed per token: the window starts now
            self.streams[i] += 1
        self.in_flight[i].add(wd)  # a new watchdog: not in the set yet
        self._active += 1
        if self._timer is None and self.tick is not None:
            self._seen = wd.last
            self._timer = self.loop.call_later(self.tick, self._sweep)
        return wd

    def discard(self, i: int, wd: Watchdog) -> None:
        """Take ``wd`` (listed, in engine ``i``'s set) out: its exchange is over."""
        wd._listed = False
        self.in_flight[i].remove(wd)
        self._active -= 1
        if wd.streamed:
            self.streams[i] -= 1

    def abort(self, i: int, why: str) -> None:
        for wd in list(self.in_flight[i]):
            wd.abort(why)

    def _sweep(self) -> None:
        self._timer = None
        seen, self._seen = self._seen, self.loop.time()
        for s in self.in_flight:
            for wd in list(s):
                wd.check(seen)
        if self.stall:
            self._check_stalls(seen)
        if self._active or any(self.suspected) and self.tick is not None:
            self._timer = self.loop.call_later(self.tick, self._sweep)

    def _check_stalls(self, now: float) -> None:
        """Stall and suspicion of every engine as of ``now`` (the previous sweep's time)."""
        counters_at = self._counters_at
        for i, s in enumerate(self.in_flight):
            # Only streams waiting on the engine: one writing to a slow client owes it nothing, and a
            # non-streamed answer owes no byte before its end (its own budget covers it).
            waiting = self.streams[i] > 0 and any(wd.streamed and wd.last is not None for wd in s)
            last = self.progress_at[i]
            if counters_at is not None and (c := counters_at(i)) is not None and c > last:
                last = c
            quiet = now - last if waiting else 0.0
            if self._on_suspect is not None and self.suspected[i] != (quiet >= self.suspect_after):
                self.suspected[i] = not self.suspected[i]
                self._on_suspect(i, self.suspected[i])
            if quiet < self.stall:
                continue
            self.progress_at[i] = now  # re-armed: reported again after another window without progress
            assert self._on_stall is not None
            self._on_stall(i, f"no progress for {now - last:.3g} s with {len(s)} request(s) in flight "
                              f"(stall timeout {self.stall:g} s)")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
