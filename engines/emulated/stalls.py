"""Host stalls: the rare, long delays of a step or of a request's way in that a busy host adds beyond
its typical slowdown, drawn at random at the measured rate and lengths.

Why they exist: engines of vLLM's CPU build share a host's few cores with their API servers, their
unpinned engine-core processes, a gateway and the client. When more threads are runnable than there
are cores, the OS preempts one of them for a scheduler slice or several: the engine's worker in the
middle of a step (the step ends that much later), or the API server or engine-core process while a
request is on its way in or its first token on its way out. The typical contention (every step a
little slower) is the host model's (:mod:`engines.emulated.host_cpu`, :mod:`engines.emulated.shared_host`);
these are the tail: on the measured pair a tenth of the requests took over 100 ms longer than their
typical time, and a mean model (a factor on every step) cannot make that tail.

The model (``stalls`` in a profile; measured by ``gpuhit profile fit --stall-requests``,
:mod:`replayer.calibrate_stalls`):

* **steps**: preemptions arrive at ``step_rate_per_s`` per second of step time (a long prefill step
  is hit more often than a short decode step), so a step of ``d`` seconds is stalled with
  probability ``min(1, step_rate_per_s * d)``, by a length drawn from ``step_lengths_s`` (the
  measured excesses over the typical step). Over many steps the mean added time per second of step
  time is ``step_rate_per_s * mean(step_lengths_s)``: what the fit measured. Where a host model
  times the step (``host_cpu`` / ``host_contention``, whose factor is a mean over the shared-host
  probe's steps, stalls included), steps stall only while that factor is above 1 (the host
  oversubscribed: the condition for a preemption) and their typical part is the factor's time over
  ``1 + step_rate_per_s * mean(step_lengths_s)``: the mean step stays the host model's, the stalls
  move part of it into a tail (:meth:`StallSampler.step`).
* **requests**: with probability ``request_p`` a request's way in (the engine's frontend delay) is
  longer by a length drawn from ``request_lengths_s`` (the measured excesses of vLLM's own time
  outside its steps: the API server's input and output handling, the hand-off to and from the
  engine-core process, the queue). The fitted frontend delay is a typical one (a robust fit).
* **the client's path**: with probability ``path_p`` a request's path (client, gateway, HTTP: the
  client's latency less vLLM's) is longer by a length from ``path_lengths_s``; the live-path model
  (:mod:`replayer.live_path`), a mean per count of requests in flight, gives up the stalls' mean
  (:meth:`StallSampler.path`).

Each engine draws from its own generator seeded from the run's seed and its index
(:meth:`Stalls.sampler`), so a run's records are reproducible and two runs with different seeds
meet different stalls; the path's draws come from the run's seed in the simulator's post-pass. On a
host whose steps run on accelerators (``--engine-cores 0``) the fit writes no step stalls: the device
times the step, a preempted host thread only delays its launch, which the typical step time already
holds; on a host with cores to spare the probe measures few stalls of any kind. A profile without
``stalls`` times every step and every request exactly as before, with no draw at all.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhit.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Stalls:
    """The measured stall rates and lengths of one host (see module docstring)."""

    step_rate_per_s: float = 0.0
    step_lengths_s: tuple[float, ...] = ()
    request_p: float = 0.0
    request_lengths_s: tuple[float, ...] = ()
    path_p: float = 0.0
    path_lengths_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        nums = (self.step_rate_per_s, self.request_p, self.path_p, *self.step_lengths_s, *self.request_lengths_s,
                *self.path_lengths_s)
        if not all(math.isfinite(x) and x >= 0 for x in nums) or self.request_p > 1 or self.path_p > 1:
            raise ConfigError(f"stalls need finite, non-negative rates and lengths, probabilities <= 1: {self}")
        if any((rate > 0) != bool(lengths) for rate, lengths in ((self.step_rate_per_s, self.step_lengths_s),
                                                                (self.request_p, self.request_lengths_s),
                                                                (self.path_p, self.path_lengths_s))):
            raise ConfigError(f"a stall rate needs measured lengths and lengths a rate: {self}")

    @property
    def steps(self) -> bool:
        """Whether steps stall (a step's time then depends on a draw: no decode jumps)."""
        return self.step_rate_per_s > 0

    def mean_step_excess(self) -> float:
        """Seconds added per second of step time, on average."""
        return self.step_rate_per_s * (sum(self.step_lengths_s) / len(self.step_lengths_s)) if self.steps else 0.0

    def mean_request_excess(self) -> float:
        """Seconds added to a request's way in, on average."""
        return self.request_p * sum(self.request_lengths_s) / len(self.request_lengths_s) if self.request_p else 0.0

    def mean_path_excess(self) -> float:
        """Seconds added to a request's path (client, gateway, HTTP), on average."""
        return self.path_p * sum(self.path_lengths_s) / len(self.path_lengths_s) if self.path_p else 0.0

    def sampler(self, seed: int | str) -> StallSampler:
        """An engine's own draws, reproducible from ``seed`` (the run's seed and the engine's index)."""
        return StallSampler(self, random.Random(f"stalls/{seed}"))

    def to_json(self) -> dict[str, Any]:
        return {"step_rate_per_s": self.step_rate_per_s, "step_lengths_s": list(self.step_lengths_s),
                "request_p": self.request_p, "request_lengths_s": list(self.request_lengths_s),
                "path_p": self.path_p, "path_lengths_s": list(self.path_lengths_s)}


class StallSampler:
    """One engine's stall draws (:class:`Stalls`), from its own seeded generator."""

    __slots__ = ("model", "rng")

    def __init__(self, model: Stalls, rng: random.Random):
        self.model, self.rng = model, rng

    def step(self, step_s: float, host_factor: float | None = None) -> float:
        """The time of a step of ``step_s`` seconds (its host's factor applied, ``host_factor`` that
        factor; None: the engine has no host model) once the host's stalls are drawn.

        Where a host model timed the step, its factor is a mean over the shared-host probe's steps,
        stalls included: then the step is stalled only while the host is oversubscribed (factor
        above 1: more runnable threads than cores, the condition for a preemption), and its typical
        part is the factor's time over ``1 + mean_step_excess`` so that the mean step time stays the
        host model's (the stalls redistribute it into a tail). Without a host model, the step's time
        is a typical one (a robust fit) and the stalls add to it."""
        m = self.model
        if m.step_rate_per_s <= 0:
            return step_s
        if host_factor is not None:
            if host_factor <= 1.0:
                return step_s
            step_s /= 1.0 + m.mean_step_excess()
        if self.rng.random() < m.step_rate_per_s * step_s:
            step_s += self.rng.choice(m.step_lengths_s)
        return step_s

    def request(self) -> float:
        """Seconds a request's way in is stalled by (0.0 mostly)."""
        m = self.model
        if m.request_p <= 0 or self.rng.random() >= m.request_p:
            return 0.0
        return self.rng.choice(m.request_lengths_s)

    def path(self, lag_s: float) -> float:
        """A request's delay on the client's path given the path model's mean lag ``lag_s`` for it:
        that lag less the stalls' mean (the lag is measured as a mean, stalls included), plus a draw."""
        m = self.model
        if m.path_p <= 0:
            return lag_s
        lag_s = max(0.0, lag_s - m.mean_path_excess())
        if self.rng.random() < m.path_p:
            lag_s += self.rng.choice(m.path_lengths_s)
        return lag_s


def stalls_of(d: Any, where: str) -> Stalls:
    """``stalls`` as a profile file writes it (:meth:`Stalls.to_json`); unknown keys are refused."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: stalls must be an object, got {d!r}")
    known = set(Stalls.__dataclass_fields__)
    if set(d) - known:
        raise ConfigError(f"{where}: stalls takes only {sorted(known)}; got {sorted(d)}")
    try:
        kw: dict[str, Any] = {k: (tuple(float(x) for x in v) if isinstance(v, Sequence) else float(v))
                              for k, v in d.items()}
        return Stalls(**kw)
    except (TypeError, ValueError, ConfigError) as exc:
        raise ConfigError(f"{where}: stalls: {exc}") from None
