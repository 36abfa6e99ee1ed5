"""A virtual-time asyncio event loop: the same coroutines, with the clock jumping to the next timer.

Engines and the gateway read time only through ``loop.time()`` (or an injected clock), so they run
unchanged on this loop, where ``asyncio.sleep(10)`` completes instantly and ``loop.time()`` advances
by exactly 10. The loop is a plain :class:`asyncio.SelectorEventLoop` whose selector never blocks:
when the loop would wait for its next timer, the virtual clock is set to that timer's deadline.
Real file descriptors (sockets, the loop's self-pipe) are still polled without blocking, so
``call_soon_threadsafe`` keeps working, but simulated code should not depend on real I/O.

If nothing is runnable and no timer is scheduled the simulation can never progress; instead of
hanging forever the loop raises :class:`gpuhit.errors.DeadlockError`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

from gpuhit.errors import DeadlockError

T = TypeVar("T")


class _NonBlockingSelector(selectors.BaseSelector):
    """Delegates to a real selector but polls with timeout 0 and advances the virtual clock."""

    # With only the loop's self-pipe registered, a real poll each iteration is a wasted syscall
    # (~5% of a simulation): callbacks from threads are already queued by call_soon_threadsafe,
    # the pipe byte only wakes a *blocking* select, which this loop never does. Poll it every
    # POLL_EVERY iterations so the pipe is drained; poll every time once other fds are registered.
    POLL_EVERY = 64

    def __init__(self, loop: VirtualTimeLoop):
        self._real = selectors.DefaultSelector()
        self._loop = loop
        self._skipped = 0

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self):
        self._real.close()

    def select(self, timeout=None):
        if len(self._real.get_map()) > 1 or self._skipped >= self.POLL_EVERY or timeout is None:
            self._skipped = 0
            ready = self._real.select(0)
            if ready:
                return ready
        else:
            self._skipped += 1
        if timeout is None:
            # A thread may still wake us through the self-pipe: give it a short real wait first.
            ready = self._real.select(self._loop.idle_grace)
            if ready:
                return ready
            raise DeadlockError(
                "virtual-time loop is idle with no timer scheduled: every task is waiting on "
                "something that can never happen"
            )
        if timeout > 0:
            self._loop._advance_to_next_timer(timeout)
        return []


class _FifoTimerHandle(asyncio.TimerHandle):
    """A timer that sorts by (deadline, creation order): timers due at the same instant run in
    the order they were set.

    Why: asyncio orders its timer heap by deadline alone, so equal deadlines pop in an order that
    depends on the heap's shape, i.e. on every other timer pending. In virtual time equal deadlines
    are common (sessions released together, zero think times), and a simulation must not route
    them differently because an unrelated engine happened to set more timers (a decode jump sets
    fewer than stepping does).
    """

    __slots__ = ("_seq",)

    def __lt__(self, other: object) -> bool:
        # compared by the heap on every push and pop (a simulated run: about a million times), so
        # without building (deadline, seq) tuples
        if type(other) is _FifoTimerHandle:
            w, o = self._when, other._when
            return w < o or (w == o and self._seq < other._seq)
        return super().__lt__(other)  # type: ignore[operator]


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Event loop whose ``time()`` is virtual and jumps forward instead of sleeping.

    ``start`` sets the initial clock value (seconds). ``idle_grace`` is the real time, in seconds,
    the loop waits for a thread to wake it before declaring a deadlock.
    """

    def __init__(self, start: float = 0.0, idle_grace: float = 0.5):
        self._now = float(start)
        self._timer_seq = itertools.count()
        self.idle_grace = idle_grace
        super().__init__(selector=_NonBlockingSelector(self))
        # Timers due within this resolution run together; keep it tiny but non-zero.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def call_at(self, when, callback, *args, context=None):  # type: ignore[override]
        """``BaseEventLoop.call_at`` with a FIFO tie-break between equal deadlines (see
        :class:`_FifoTimerHandle`)."""
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()
        timer = _FifoTimerHandle(when, callback, args, self, context)
        timer._seq = next(self._timer_seq)
        if timer._source_traceback:
            del timer._source_traceback[-1]
        heapq.heappush(self._scheduled, timer)
        timer._scheduled = True
        return timer

    def _advance_to_next_timer(self, timeout: float) -> None:
        scheduled = self._scheduled  # heap of TimerHandle, owned by BaseEventLoop
        if scheduled:
            when = scheduled[0].when()
            # Jump exactly to the deadline so float round-off cannot leave it "not yet due".
            self._now = max(self._now, when)
        else:
            self._now += timeout


def run(coro: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop` and close the loop."""
    loop = VirtualTimeLoop(start=start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def run_live(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` in real time, on uvloop when it is installed (live serving and live replay)."""
    try:
        import uvloop
    except ImportError:  # uvloop is a core dependency on Linux; plain asyncio elsewhere
        return asyncio.run(coro)
    return uvloop.run(coro)
