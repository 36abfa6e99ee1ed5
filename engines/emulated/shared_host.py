"""Engines that share a host's cores: a step slows down while the host's other engines also work.

On a GPU server each engine has its own accelerator and this coupling is absent. Engines of the CPU
build that share a host's cores (each bound to its own, but with their API servers, a gateway and
a client beside them on the same few cores) do slow each other down: with both of two such
engines busy, a step took 1.4-2x its time alone (``analysis/results/live-path-loaded-2026-11-27.md``).
``gpuhit profile fit`` measures the factor per count of busy engines (:mod:`replayer.calibrate_host`)
into the profile's ``host_contention``; :func:`replayer.sim_engines.emulated_factory` puts
consecutive engines, as many as the profile's table is long, on one :class:`SharedHost`.

The mechanism is deliberately the simplest one a measurement can pin down: when an engine starts a
step, the step's time is multiplied by the factor for the number of engines on its host that have
work then (running or waiting requests; an engine with work steps without pause, so that is the
count of engines mid-step), itself included. The count is read once per step, not integrated over
it: a step lasts milliseconds, an engine's busy period seconds.

A profile with ``host_cpu`` (:mod:`engines.emulated.host_cpu`) is timed by the host's CPU demand
instead: the same count of busy engines, plus the requests that arrived over the model's window
(:meth:`SharedHost.arrived`) and the tokens per second each busy engine produced in its last step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from engines.emulated.host_cpu import HostCPU
from gpuhit.errors import ConfigError


class SharedHost:
    """The engines on one host and how their steps slow each other: the measured step-time factor by
    how many of them are busy (``factors``), or the host's CPU demand model (``cpu``)."""

    __slots__ = ("_arrivals", "_rate", "cpu", "engines", "factors")

    def __init__(self, factors: Sequence[float] = (), cpu: HostCPU | None = None):
        if cpu is None and (not factors or factors[0] != 1.0 or min(factors) <= 0):
            raise ConfigError(f"a shared host needs positive factors, 1.0 for one busy engine: {list(factors)}")
        self.factors = tuple(float(f) for f in factors)
        self.cpu = cpu
        self.engines: list[Any] = []
        self._arrivals: deque[float] = deque()  # arrival times within the CPU model's window
        self._rate: list[float] = []  # per engine: tokens per second in its last step

    def join(self, engine: Any) -> None:
        size = self.cpu.engines if self.cpu is not None else len(self.factors)
        if len(self.engines) >= size:
            raise ConfigError(f"the host's model covers {size} engines; a {len(self.engines) + 1}th joined")
        self.engines.append(engine)
        self._rate.append(0.0)

    def arrived(self, now: float) -> None:
        """A request reached one of the host's engines (its frontend's per-request work)."""
        if self.cpu is not None:
            self._arrivals.append(now)

    def factor(self, engine: Any, now: float = 0.0, tokens: int = 0, step_s: float = 0.0) -> float:
        """The factor for a step ``engine`` starts now (``engine`` itself counts as busy, since it is
        starting a step): by the count of the host's engines with work, or, with a CPU model, by the
        demand at ``now`` with this step producing ``tokens`` tokens in ``step_s`` profile seconds."""
        if self.cpu is None:
            busy = 1
            for e in self.engines:
                if e is not engine:
                    s = e.scheduler
                    if s.running or s.waiting:
                        busy += 1
            return self.factors[busy - 1]
        me = self.engines.index(engine)
        busy = []
        token_rate = tokens / step_s if step_s > 0 else 0.0
        for i, e in enumerate(self.engines):
            if e is engine:
                busy.append(i)
            elif e.scheduler.running or e.scheduler.waiting:
                busy.append(i)
                token_rate += self._rate[i]
        window = self.cpu.window_s
        arrivals = self._arrivals
        while arrivals and arrivals[0] <= now - window:
            arrivals.popleft()
        f = self.cpu.factor(me, busy, len(arrivals) / window, token_rate)
        self._rate[me] = tokens / (step_s * f) if step_s > 0 else 0.0
        return f
