"""Which engines take traffic, and why not: the router's health marks.

An engine leaves the routable set when the gateway's health checks or circuit breakers say so
(:meth:`InstanceHealth.mark_unhealthy`), or after ``unhealthy_after`` consecutive failed requests
(:meth:`InstanceHealth.failed`), and comes back with :meth:`InstanceHealth.mark_healthy`. Kept
apart from :mod:`gateway.router`, which reads :attr:`InstanceHealth.ok` in every snapshot (the
list itself, not a copy) and refuses a policy's choice of an engine marked out.
"""

from __future__ import annotations

from gpuhit.errors import ConfigError


class InstanceHealth:
    """Per engine: routable or not (``ok``), why not (``reason``) and its run of failed requests."""

    __slots__ = ("consecutive_errors", "ok", "reason", "unhealthy_after")

    def __init__(self, n: int, unhealthy_after: int | None = None):
        if unhealthy_after is not None and unhealthy_after <= 0:
            raise ConfigError("unhealthy_after must be positive or None")
        self.unhealthy_after = unhealthy_after
        self.ok = [True] * n
        self.reason: list[str | None] = [None] * n
        self.consecutive_errors = [0] * n

    def check(self, i: int) -> None:
        if not 0 <= i < len(self.ok):
            raise ConfigError(f"instance {i} out of range 0..{len(self.ok) - 1}")

    def mark_unhealthy(self, i: int, reason: str) -> None:
        self.check(i)
        self.ok[i] = False
        self.reason[i] = reason

    def mark_healthy(self, i: int) -> None:
        self.check(i)
        self.ok[i] = True
        self.reason[i] = None
        self.consecutive_errors[i] = 0

    def failed(self, i: int, reason: str) -> None:
        """A request on engine ``i`` failed: out after ``unhealthy_after`` in a row (None: never)."""
        self.consecutive_errors[i] += 1
        n = self.consecutive_errors[i]
        if self.unhealthy_after is not None and n >= self.unhealthy_after:
            self.mark_unhealthy(i, f"{n} consecutive errors, last: {reason}")


__all__ = ["InstanceHealth"]
