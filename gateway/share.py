"""Shared routing state between gateway replicas: the mechanism, independent of the transport.

Several ``gpuhit serve`` replicas behind one load balancer each see the KV index through the
engines' events, but the load a policy ranks on — pending prefill, in-flight, decoding sequences,
active blocks, requests routed so far — and the session bindings are counted by each replica's
own :class:`~gateway.router.Router`. A :class:`ShareLink` makes one router's view include the
others':

* **Out.** The router's five per-instance counters are replaced by :class:`SharedCounter` lists
  that record every change the router makes (a decision adds its predicted new prefill tokens,
  in-flight and routed counts; first token and finish take them back), and the binding table by
  :class:`SharedBindings`. After a change the link hands the transport a *state message*: this
  replica's OWN totals per counter and instance (not deltas), plus the bindings it changed.
* **Stored responses.** Given the gateway's
  :class:`~gateway.dialects.history.ResponseHistory`, the link also sends each response this
  replica recorded (id, engine, session, and the messages a continuation renders when they fit in
  ``max_response_bytes``), so a ``previous_response_id``, ``GET`` or ``cancel`` arriving at
  another replica reaches the engine that stored it. An entry is a fact that never changes, so
  applying it twice is harmless; a continuation whose messages were too large is still pinned to
  the right engine, only tokenized approximately.
* **In.** :meth:`ShareLink.receive` replaces the sender's previous totals with the new ones and
  adds the difference to the router's counters, so ``counter = own + sum(others' last totals)``;
  bindings are applied as they come.

Totals rather than deltas make the messages idempotent: a lost or duplicated message is repaired
by the next one, a replica that joins late is right after each peer's next message, and a
replica that leaves (``bye``) or goes silent (:meth:`ShareLink.expire`) is subtracted exactly.

Transports: :mod:`gateway.share_redis` (Redis pub/sub, live) and
:class:`replayer.replicas.SimBus` (in process, with a propagation delay, simulated).

The router's counters are private lists of :class:`~gateway.router.Router`; :func:`ShareLink`
swaps them in place at attach time (before any request), which keeps the router free of any
sharing code. ``COUNTERS`` names them; a router without one of them is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson

from gateway.bindings import DEFAULT_MAX_SESSIONS, SessionBindings
from gpuhit.errors import ConfigError

if TYPE_CHECKING:
    from gateway.dialects.history import ResponseHistory

# The router's per-instance counters that policies rank on (gateway/router.py), in message order.
COUNTERS = ("_in_flight", "_pending", "_pending_work", "_decode", "_active_blocks", "_routed")
MESSAGE_VERSION = 2
# A stored response's continuation messages travel with its entry up to this size (JSON bytes);
# larger ones travel without them (the engine is what a continuation must reach).
MAX_RESPONSE_BYTES = 64 * 1024


class SharedCounter(list):
    """A router counter list that tracks this replica's own part and reports each change.

    The router does ``counter[i] += x``; that goes through :meth:`__setitem__`, which keeps
    ``own`` (this replica's contribution) in step and calls ``changed()``. Peers' contributions
    are added with :meth:`add_remote`, which reports nothing.
    """

    __slots__ = ("changed", "own")

    def __init__(self, values: list[int], changed: Callable[[], None]):
        super().__init__(values)
        self.own = list(values)
        self.changed = changed

    def __setitem__(self, i: int, v: int) -> None:  # type: ignore[override]
        old = list.__getitem__(self, i)
        if v != old:
            list.__setitem__(self, i, v)
            self.own[i] += v - old
            self.changed()

    def add_remote(self, i: int, delta: int) -> None:
        list.__setitem__(self, i, list.__getitem__(self, i) + delta)


class SharedBindings(SessionBindings):
    """Session bindings whose local changes are reported, and peers' applied silently."""

    __slots__ = ("changed",)

    def __init__(self, changed: Callable[[str, int, float | None], None],
                 max_sessions: int = DEFAULT_MAX_SESSIONS):
        super().__init__(max_sessions)
        self.changed = changed

    def bind(self, session: str | None, instance: int) -> None:
        if session is not None and self.get(session) != instance:
            super().bind(session, instance)
            self.changed(session, instance, None)

    def migrated(self, session: str | None, instance: int, now: float) -> None:
        if session is not None:
            super().migrated(session, instance, now)
            self.changed(session, instance, now)

    def apply(self, session: str, instance: int, migrated_at: float | None) -> None:
        if migrated_at is None:
            SessionBindings.bind(self, session, instance)
        else:
            SessionBindings.migrated(self, session, instance, migrated_at)


class ShareLink:
    """One router's end of the shared state (see the module docstring).

    ``on_dirty()`` is called when the link goes from nothing to send to something to send; the
    transport then calls :meth:`message` (now, or once per loop tick to coalesce a decision's
    several changes into one message) and sends what it returns to every peer, which passes it to
    its own link's :meth:`receive`.
    """

    def __init__(self, router: Any, replica_id: str, on_dirty: Callable[[], None], *,
                 history: ResponseHistory | None = None, max_response_bytes: int = MAX_RESPONSE_BYTES):
        if not replica_id:
            raise ConfigError("a shared-state replica needs a non-empty id")
        self.router = router
        self.replica_id = replica_id
        self._on_dirty = on_dirty
        self._dirty = False
        self._seq = 0
        self._bindings_out: list[list[Any]] = []
        self._responses_out: list[list[Any]] = []
        self.history = history
        self.max_response_bytes = max_response_bytes
        self.responses_in = 0
        self.responses_out = 0
        self.responses_trimmed = 0  # sent without their messages (larger than max_response_bytes)
        self._peers: dict[str, list[list[int]]] = {}  # peer id -> its last totals per counter
        self._peer_seen: dict[str, float] = {}  # peer id -> time of its last message (for expire)
        self._peer_seq: dict[str, int] = {}  # peer id -> seq of its last applied message
        self.messages_in = 0
        self.messages_out = 0
        n = len(router.engines)
        counters = []
        for name in COUNTERS:
            cur = getattr(router, name, None)
            if not isinstance(cur, list) or len(cur) != n:
                raise ConfigError(f"router has no per-instance counter {name}: this gateway/router.py does not "
                                  "match gateway/share.py")
            c = SharedCounter(cur, self._changed)
            setattr(router, name, c)
            counters.append(c)
        self.counters: tuple[SharedCounter, ...] = tuple(counters)
        old = router.bindings
        nb = SharedBindings(self._bound, old.max_sessions)
        for s, i in old.items():
            SessionBindings.bind(nb, s, i)
        router.bindings = nb
        if history is not None:
            history.on_record = self._recorded

    # -- out ---------------------------------------------------------------------------------------

    def _changed(self) -> None:
        if not self._dirty:
            self._dirty = True
            self._on_dirty()

    def _bound(self, session: str, instance: int, migrated_at: float | None) -> None:
        self._bindings_out.append([session, instance, migrated_at])
        self._changed()

    def _recorded(self, response_id: str, engine: str, after: list[dict[str, Any]] | None,
                  session: str) -> None:
        if after is not None and len(orjson.dumps(after)) > self.max_response_bytes:
            after = None
            self.responses_trimmed += 1
        self._responses_out.append([response_id, engine, session, after])
        self.responses_out += 1
        self._changed()

    def message(self) -> dict[str, Any]:
        """This replica's state message: its own totals, and the bindings changed and responses
        recorded since the last one."""
        self._dirty = False
        self._seq += 1
        self.messages_out += 1
        b, self._bindings_out = self._bindings_out, []
        msg = {"v": MESSAGE_VERSION, "from": self.replica_id, "seq": self._seq,
               "own": [list(c.own) for c in self.counters], "bind": b}
        if self._responses_out:
            msg["resp"], self._responses_out = self._responses_out, []
        return msg

    def requeue(self, msg: Mapping[str, Any]) -> None:
        """A message that could not be sent: its bindings and responses go out with the next one
        (totals always do)."""
        self._bindings_out[:0] = list(msg.get("bind", ()))
        self._responses_out[:0] = list(msg.get("resp", ()))

    def bye(self) -> dict[str, Any]:
        """The message a replica sends when it leaves: peers drop its totals."""
        return {"v": MESSAGE_VERSION, "from": self.replica_id, "bye": True}

    # -- in ----------------------------------------------------------------------------------------

    def receive(self, msg: Mapping[str, Any], now: float | None = None) -> None:
        """Apply a peer's message (this replica's own messages are ignored). Malformed: ConfigError."""
        origin = msg.get("from")
        if origin == self.replica_id:
            return
        if msg.get("v") != MESSAGE_VERSION or not isinstance(origin, str):
            raise ConfigError(f"shared-state message of an unknown version or sender: {dict(msg)!r:.200}")
        self.messages_in += 1
        if msg.get("bye"):
            self.drop(origin)
            return
        seq = msg["seq"]
        if seq <= self._peer_seq.get(origin, 0):
            return  # older than what we applied (a transport that reorders): totals only move forward
        own = msg["own"]
        n = len(self.router.engines)
        if len(own) != len(COUNTERS) or any(len(x) != n for x in own):
            raise ConfigError(f"replica {origin} shares counters for another number of instances than this "
                              f"gateway's {n}: are both configured with the same engines, in the same order?")
        prev = self._peers.get(origin)
        for k, c in enumerate(self.counters):
            new = own[k]
            old = prev[k] if prev is not None else None
            for i in range(n):
                d = new[i] - (old[i] if old is not None else 0)
                if d:
                    c.add_remote(i, d)
        self._peers[origin] = [list(x) for x in own]
        self._peer_seq[origin] = seq
        if now is not None:
            self._peer_seen[origin] = now
        bindings: SharedBindings = self.router.bindings
        for session, instance, migrated_at in msg.get("bind", ()):
            if not (isinstance(instance, int) and 0 <= instance < n):
                raise ConfigError(f"replica {origin} bound session {session!r} to instance {instance!r}")
            bindings.apply(session, instance, migrated_at)
        resp = msg.get("resp", ())
        if resp and self.history is not None:
            self._apply_responses(origin, resp)

    def _apply_responses(self, origin: str, entries: Any) -> None:
        for entry in entries:
            if not (isinstance(entry, list) and len(entry) == 4 and all(isinstance(x, str) for x in entry[:3])
                    and (entry[3] is None or isinstance(entry[3], list))):
                raise ConfigError(f"replica {origin} shared a malformed stored-response entry: "
                                  f"{entry!r:.200}")
            # An engine this gateway does not serve is kept as named: a request for the response
            # then gets the API's clear "engine ... is no longer served" error.
            response_id, engine, session, after = entry
            self.history.apply(response_id, engine, after, session)  # type: ignore[union-attr]
            self.responses_in += 1

    def drop(self, origin: str) -> None:
        """Subtract a peer's last totals (it left, or went silent)."""
        prev = self._peers.pop(origin, None)
        self._peer_seen.pop(origin, None)
        self._peer_seq.pop(origin, None)
        if prev is None:
            return
        for k, c in enumerate(self.counters):
            for i, v in enumerate(prev[k]):
                if v:
                    c.add_remote(i, -v)

    def expire(self, now: float, older_than: float) -> list[str]:
        """Drop the peers not heard from for ``older_than`` seconds; returns their ids."""
        gone = [p for p, t in self._peer_seen.items() if now - t > older_than]
        for p in gone:
            self.drop(p)
        return gone

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)
