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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuhit.errors import ConfigError


class SharedHost:
    """The engines on one host and the measured step-time factor by how many of them are busy."""

    __slots__ = ("engines", "factors")

    def __init__(self, factors: Sequence[float]):
        if not factors or factors[0] != 1.0 or min(factors) <= 0:
            raise ConfigError(f"a shared host needs positive factors, 1.0 for one busy engine: {list(factors)}")
        self.factors = tuple(float(f) for f in factors)
        self.engines: list[Any] = []

    def join(self, engine: Any) -> None:
        if len(self.engines) >= len(self.factors):
            raise ConfigError(f"the host's contention table covers {len(self.factors)} engines; "
                              f"a {len(self.engines) + 1}th joined")
        self.engines.append(engine)

    def factor(self, engine: Any) -> float:
        """The factor for a step ``engine`` starts now: by the count of the host's engines with work
        (``engine`` itself counts, since it is starting a step)."""
        busy = 1
        for e in self.engines:
            if e is not engine:
                s = e.scheduler
                if s.running or s.waiting:
                    busy += 1
        return self.factors[busy - 1]
