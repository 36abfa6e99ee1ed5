"""Session -> instance bindings: where a session's KV lives, and when it last moved.

Mutable knowledge kept out of the policies (they see only ``Snapshot.binding`` and
``Snapshot.last_migrated_at``). The router updates it from the actions it carries out: a FORWARD
binds the session to the instance that ran it (its KV now lives there), a MIGRATE rebinds and
stamps the migration time, FETCH and PD leave it alone.

The table is an LRU of at most ``max_sessions`` sessions (looking a session up or binding it makes
it the most recent), so a long-lived gateway does not grow without limit. A session evicted after
that many newer sessions is treated as new: its KV has most likely been evicted from the engines
by then too, and the policies' prefix hits from the KV index still find whatever is left.
"""

from __future__ import annotations

from collections import OrderedDict

from gpuhit.errors import ConfigError

DEFAULT_MAX_SESSIONS = 65536


class SessionBindings:
    __slots__ = ("_bound", "_migrated_at", "evicted", "max_sessions")

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if not isinstance(max_sessions, int) or max_sessions <= 0:
            raise ConfigError(f"the session binding table needs a positive size, got {max_sessions!r}")
        self.max_sessions = max_sessions
        self.evicted = 0  # sessions dropped for the cap (a running total, for /debug/state)
        self._bound: OrderedDict[str, int] = OrderedDict()
        self._migrated_at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, session: str | None) -> int | None:
        if session is None:
            return None
        inst = self._bound.get(session)
        if inst is not None:
            self._bound.move_to_end(session)
        return inst

    def last_migrated_at(self, session: str | None) -> float | None:
        return None if session is None else self._migrated_at.get(session)

    def bind(self, session: str | None, instance: int) -> None:
        if session is not None:
            self._put(session, instance)

    def migrated(self, session: str | None, instance: int, now: float) -> None:
        if session is not None:
            self._put(session, instance)
            self._migrated_at[session] = now

    def _put(self, session: str, instance: int) -> None:
        b = self._bound
        b[session] = instance
        b.move_to_end(session)
        if len(b) > self.max_sessions:
            old, _ = b.popitem(last=False)
            self._migrated_at.pop(old, None)
            self.evicted += 1

    def count_on(self, instance: int) -> int:
        """Sessions bound to ``instance`` (debug; O(sessions))."""
        return sum(1 for v in self._bound.values() if v == instance)

    def items(self) -> list[tuple[str, int]]:
        return list(self._bound.items())
