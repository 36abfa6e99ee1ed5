"""Session -> instance bindings: where a session's KV lives, and when it last moved.

Mutable knowledge kept out of the policies (they see only ``Snapshot.binding`` and
``Snapshot.last_migrated_at``). The router updates it from the actions it carries out: a FORWARD
binds the session to the instance that ran it (its KV now lives there), a MIGRATE rebinds and
stamps the migration time, FETCH and PD leave it alone.
"""

from __future__ import annotations


class SessionBindings:
    __slots__ = ("_bound", "_migrated_at")

    def __init__(self) -> None:
        self._bound: dict[str, int] = {}
        self._migrated_at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, session: str | None) -> int | None:
        return None if session is None else self._bound.get(session)

    def last_migrated_at(self, session: str | None) -> float | None:
        return None if session is None else self._migrated_at.get(session)

    def bind(self, session: str | None, instance: int) -> None:
        if session is not None:
            self._bound[session] = instance

    def migrated(self, session: str | None, instance: int, now: float) -> None:
        if session is not None:
            self._bound[session] = instance
            self._migrated_at[session] = now

    def count_on(self, instance: int) -> int:
        """Sessions bound to ``instance`` (debug; O(sessions))."""
        return sum(1 for v in self._bound.values() if v == instance)

    def items(self) -> list[tuple[str, int]]:
        return list(self._bound.items())
