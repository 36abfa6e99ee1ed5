"""Late binding: hold requests at the gateway while every instance is saturated.

Routing commits a request to one engine's queue at arrival. Under overload every queue is long and
their drain times differ by whatever prompt happens to sit in each (a 50k-token cold prefill holds
an H20 for ~10 s, a 1k one for ~50 ms), so a request committed early can wait behind a long
prefill while another instance frees up first. Holding it at the gateway and choosing its instance
when one frees turns the per-instance queues into one shared queue (the M/M/c against c x M/M/1
argument; Dynamo's router queues at the router when every worker is busy and releases by fcfs or
wspt).

Mechanism here, rule in the policy: a policy that holds sets ``holds = True`` and provides
``hold(snapshot) -> bool``, a pure function of the snapshot (is every instance saturated for this
request?). :class:`HoldQueue` asks it for the request at the head of the queue:

* on arrival (:meth:`HoldQueue.admit`): with nobody held and the rule saying "no", the request
  goes on at once; otherwise it joins the queue (first come, first served: a newcomer never
  overtakes a held request);
* whenever a queued prefill ends or a request finishes (:meth:`HoldQueue.kick`, called by the
  router's tickets): the head is released if the rule now says "no"; it is then routed by the
  policy on a fresh snapshot, and its routing kicks the queue again, so several instances freeing
  at once release several requests, one decision at a time.

A released request is decided on the state at its release, not at its arrival: that is the
point. A waiter that goes away (client gone, timeout) leaves the queue when its turn comes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any


class HoldQueue:
    """FIFO of requests waiting for an instance to stop being saturated."""

    __slots__ = ("_q", "_rule", "_snapshot", "_transit", "stats")

    def __init__(self, snapshot: Callable[[Any], Any], rule: Callable[[Any], bool], stats: Any):
        self._snapshot = snapshot  # request -> Snapshot (the router's, with hits)
        self._rule = rule  # Snapshot -> hold?
        self.stats = stats  # the router's RouterStats: ``held``, ``held_max``
        self._q: deque[tuple[Any, asyncio.Future[None]]] = deque()
        # Requests let through and not yet routed: the counters do not show them yet, so no
        # other is released on the same state until they are (:meth:`routed`).
        self._transit = 0

    def __len__(self) -> int:
        return len(self._q)

    async def admit(self, req: Any) -> None:
        """Return when ``req`` may be routed: at once, or when released (module docstring). The
        caller routes it and then calls :meth:`routed`, whatever happens."""
        if not self._q and not self._transit and not self._rule(self._snapshot(req)):
            self._transit += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._q.append((req, fut))
        st = self.stats
        st.held += 1
        st.held_max = max(st.held_max, len(self._q))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # released, then abandoned before its routing
                self.routed()
            raise

    def routed(self) -> None:
        """A request let through by :meth:`admit` has been routed (or refused): release the next."""
        self._transit -= 1
        self.kick()

    def kick(self) -> None:
        """Release the head of the queue if the rule no longer holds it (one at a time: its routing
        changes the counters the rule reads, and kicks again)."""
        q = self._q
        while q and not self._transit:
            req, fut = q[0]
            if fut.done():  # its waiter went away
                q.popleft()
                continue
            if self._rule(self._snapshot(req)):
                return
            q.popleft()
            self._transit += 1
            fut.set_result(None)
