"""A client connection's one deadline and the one loop timer that watches it (the ``fast``
transport, :mod:`gateway.http.fast`).

A connection has one thing to time at a time: its request head (``head``), the body after it
(``body``), the keep-alive wait with nothing in flight (``idle``), the wait for a refused client's
last bytes (``linger``). Moving the deadline is two stores; the loop timer is re-set only when the
deadline moves earlier than it, and when it fires early (the deadline moved on since) it re-arms
for the deadline then: a request moves the deadline, not the timer, instead of cancelling and
re-creating it three times a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

_TIMER_SLACK = 1e-3  # a timer this close to its deadline counts as on time (loop timers have ms resolution)


class Deadline:
    """``kind`` and ``at`` (loop time, None: nothing timed) of a connection's deadline;
    ``on_expired(kind)`` is called when it passes."""

    __slots__ = ("_loop", "_on_expired", "_timer", "_timer_at", "at", "kind")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expired: Callable[[str], None]):
        self._loop = loop
        self._on_expired = on_expired
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self.kind = ""
        self.at: float | None = None

    def arm(self, kind: str, delay: float) -> None:
        """The deadline ``delay`` seconds from now, timer included (re-set only when it would
        fire after the deadline: moving the deadline later is the two stores)."""
        self.kind = kind
        d = self.at = self._loop.time() + delay
        if self._timer is None or self._timer_at > d:
            self.sync()

    def begun(self, kind: str, delay: float) -> None:
        """A part of a request (``head``, ``body``) is under way: timed from now unless it already
        is (it began in an earlier read)."""
        if self.kind != kind:
            self.arm(kind, delay)

    def disarm(self) -> None:
        """No deadline (the timer, if set, finds none when it fires)."""
        self.kind = ""
        self.at = None

    def sync(self) -> None:
        """Make sure the timer fires by the deadline: set it, or move it earlier; never later."""
        d = self.at
        if d is None:
            return
        t = self._timer
        if t is not None:
            if self._timer_at <= d:
                return  # it fires first and re-arms itself for the deadline then
            t.cancel()
        self._timer_at = d
        self._timer = self._loop.call_at(d, self._fired)

    def stop(self) -> None:
        """Cancel the timer (the connection is closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fired(self) -> None:
        self._timer = None
        d = self.at
        if d is None:
            return
        if d - self._loop.time() > _TIMER_SLACK:
            self.sync()  # the deadline moved on since the timer was set: wait for it
            return
        kind = self.kind
        self.disarm()
        self._on_expired(kind)
