"""Host stalls as one process across the host: an event stalls every engine step in progress, the
ways in and the client's path of the requests in flight at once.

Why: :class:`engines.emulated.stalls.StallSampler` draws each engine's stalls and each request's
from its own generator, independently. On the measured pair they are not independent: a host
stall is the OS preempting threads while more are runnable than there are cores, and it lands on
whatever runs then, both engines' workers, their API servers, the gateway and the client
(``tests/perf/stall_correlation.py`` measures it on a live folder with engine spans: whether
requests sent while an engine request was stalled meet a long path more often than the others, and
whether the two engines' stalls at overlapping times co-occur above chance). Independent draws give the
tail the right size but spread it over the wrong requests: a policy that keeps both engines busy at
once meets the host's stalls together, one that queues on one engine meets them one at a time.

The model keeps every part's mean and changes only the correlation. Events arrive in the run's
virtual time as a Poisson process at the profile's ``step_rate_per_s`` (its stall rate per second
of step time: an engine busy for ``d`` seconds meets ``rate x d`` events on average, as before), each
with a uniform draw ``u``. An event that falls in a step's typical interval stalls it by the
``u``-quantile of the step lengths (several events add up). A request's way in is stalled when an
event falls within ``w = -ln(1 - request_p) / rate`` after its arrival (probability ``request_p``, as
before), by the ``u``-quantile of the request lengths; the client's path alike with ``path_p`` and
the path lengths. One ``u`` per event draws every part's length at the same quantile: a long
preemption is long for everything it hits. Events come from one generator seeded by the run's seed
(:meth:`HostTimeline.of`), so the engines and the simulator's post-pass on the path, which builds
the timeline again from the same seed, see the same events; records are reproducible.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

from engines.emulated.stalls import Stalls
from gpuhit.errors import ConfigError


class HostTimeline:
    """One run's host stall events in virtual time (times and uniform draws), extended on demand."""

    __slots__ = ("draws", "rate", "rng", "times")

    def __init__(self, rate_per_s: float, rng: random.Random):
        if not rate_per_s > 0 or not math.isfinite(rate_per_s):
            raise ConfigError(f"host-wide stalls need a positive event rate (the steps' stall rate), got {rate_per_s}")
        self.rate, self.rng = rate_per_s, rng
        self.times: list[float] = []
        self.draws: list[float] = []

    @classmethod
    def of(cls, model: Stalls, seed: int | str) -> HostTimeline:
        """The timeline of a run with ``seed`` (the same seed gives the same events)."""
        return cls(model.step_rate_per_s, random.Random(f"host-stalls/{seed}"))

    def events(self, t0: float, t1: float) -> list[float]:
        """The uniform draws of the events in ``[t0, t1)``, in time order."""
        if t1 <= t0:
            return []
        while not self.times or self.times[-1] < t1:
            # the first event after the origin of the virtual clock; later ones by exponential gaps
            self.times.append((self.times[-1] if self.times else 0.0) + self.rng.expovariate(self.rate))
            self.draws.append(self.rng.random())
        return self.draws[bisect.bisect_left(self.times, t0):bisect.bisect_left(self.times, t1)]


def quantile(ordered: Sequence[float], u: float) -> float:
    """The ``u``-quantile of measured lengths (sorted), as a draw: each length equally likely over uniform ``u``."""
    return ordered[min(int(u * len(ordered)), len(ordered) - 1)]


class HostStallSampler:
    """An engine's (or the path's) view of the host's events: the interface of
    :class:`engines.emulated.stalls.StallSampler`, with the time each draw is for."""

    __slots__ = ("_paths", "_requests", "_steps", "_w_path", "_w_request", "model", "timeline")

    def __init__(self, model: Stalls, timeline: HostTimeline):
        self.model, self.timeline = model, timeline
        self._steps, self._requests, self._paths = (tuple(sorted(x)) for x in (
            model.step_lengths_s, model.request_lengths_s, model.path_lengths_s))
        # the window after arrival in which an event hits: P(>= 1 event) = p at the event rate
        self._w_request = -math.log1p(-min(model.request_p, 1 - 1e-12)) / timeline.rate
        self._w_path = -math.log1p(-min(model.path_p, 1 - 1e-12)) / timeline.rate

    def step(self, step_s: float, host_factor: float | None = None, now: float = 0.0) -> float:
        """As :meth:`StallSampler.step`; the events in the step's typical interval from ``now`` stall it."""
        m = self.model
        if host_factor is not None:
            if host_factor <= 1.0:
                return step_s
            step_s /= 1.0 + m.mean_step_excess()
        return step_s + sum(quantile(self._steps, u) for u in self.timeline.events(now, now + step_s))

    def request(self, now: float = 0.0) -> float:
        """As :meth:`StallSampler.request`, for a request arriving at ``now``."""
        if self.model.request_p <= 0:
            return 0.0
        hit = self.timeline.events(now, now + self._w_request)
        return quantile(self._requests, hit[0]) if hit else 0.0

    def path(self, lag_s: float, now: float = 0.0) -> float:
        """As :meth:`StallSampler.path`, for a request sent at ``now``."""
        m = self.model
        if m.path_p <= 0:
            return lag_s
        lag_s = max(0.0, lag_s - m.mean_path_excess())
        hit = self.timeline.events(now, now + self._w_path)
        return lag_s + (quantile(self._paths, hit[0]) if hit else 0.0)


def samplers(model: Stalls, seed: int) -> Callable[[int | str], Any]:
    """The stall sampler of each engine (by index) and of the client's path (``"path"``) of a run
    with ``seed``: each its own generator (:meth:`Stalls.sampler`), or, with ``host_wide``, views of
    one host timeline built from the seed (the path's, built again from the seed in the simulator's
    post-pass, sees the events the engines met)."""
    if not model.host_wide:
        return lambda who: model.sampler(f"path/{seed}" if who == "path" else f"{seed}/{who}")
    timeline = HostTimeline.of(model, seed)
    return lambda who: HostStallSampler(model, timeline)
