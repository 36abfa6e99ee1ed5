"""The live path's delay as the simulator applies it: what the client, the gateway and HTTP add to a
request beyond what the engine's own frontend delay (the profile's) already holds, as a function of
the requests in flight at the gateway when it arrives.

Why a function of the in-flight count: on live engines the path is not a constant. A lone probe
pays a few milliseconds, but during a run the client, the gateway and every engine's API server
relay several streams at once on cores the engines' workers also use, and each hop (client ->
gateway -> API server -> engine core and back) waits for a core where they are busy.
``gpuhit profile fit`` measures it the way a run meets it (``measure_path_loaded`` in
:mod:`replayer.calibrate_path`): closed loops of ``k + 1`` clients sending cold prompts of the trace's
sizes through a gateway in front of every engine, so that each request meets about ``k`` others in
flight, mostly in long prefills that keep the engines busy, as in a run; per ``k``, the requests'
mean client TTFT minus vLLM's own mean TTFT (which starts when its API server takes the request),
against the mean count each met, in ``fit.live_path.by_in_flight``. The model interpolates linearly
between the measured counts and stays flat beyond the last (no extrapolation past what was
measured). A profile that measured only lone pairs gives the constant model: its one point, the
gateway's addition at no other request in flight.

The profile's frontend delay (``frontend_overhead_s``, fitted on lone probes sent straight to the
engine) already holds the direct client's path; this model adds the difference, path at ``k`` minus
that lone direct path, where the request crosses the gateway (:class:`replayer.simulate.SimTarget`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuhit.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LivePathModel:
    """Extra seconds on a request's path given the requests in flight at the gateway as it arrives:
    linear between ``points`` (``(in_flight, seconds)``, increasing counts: means measured under load
    need not be whole), flat outside them."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        ks = [k for k, _ in self.points]
        if not ks or ks != sorted(set(ks)) or ks[0] < 0 or not all(math.isfinite(k) for k in ks):
            raise ConfigError(f"a live-path model needs distinct, increasing, non-negative in-flight counts: {ks}")
        if any(not math.isfinite(s) or s < 0 for _, s in self.points):
            raise ConfigError(f"a live-path model's delays must be finite and non-negative: {self.points}")

    def __call__(self, in_flight: float) -> float:
        ks = [k for k, _ in self.points]
        i = bisect.bisect_right(ks, in_flight)
        if i == 0:
            return self.points[0][1]
        if i == len(ks):
            return self.points[-1][1]
        (k0, s0), (k1, s1) = self.points[i - 1], self.points[i]
        return s0 + (s1 - s0) * (in_flight - k0) / (k1 - k0)

    @property
    def constant(self) -> bool:
        return len(self.points) == 1

    def describe(self) -> str:
        return ", ".join(f"{k:g}: {s * 1e3:.1f} ms" for k, s in self.points)


def from_fit(live_path: Mapping[str, Any] | None, by_in_flight: bool = True) -> LivePathModel | None:
    """The model of a profile's ``fit.live_path``: the measured path per in-flight count less the lone
    direct path (negative differences, noise around a path the frontend already holds, count as 0),
    or with ``by_in_flight`` False or no such measurement, the constant gateway addition of the lone
    pairs. None when the fit measured neither."""
    lp = live_path or {}
    direct = float(lp.get("direct_path_s", math.nan))
    rows = lp.get("by_in_flight") or []
    if by_in_flight and rows and math.isfinite(direct):
        return LivePathModel(tuple(sorted((float(r["in_flight"]), max(float(r["path_s"]) - direct, 0.0))
                                          for r in rows)))
    gw = float(lp.get("gateway_ttft_s", math.nan))
    if math.isfinite(gw):
        return LivePathModel(((0, max(gw, 0.0)),))
    return None


def in_flight_at_arrival(arrival: Sequence[float], finish: Sequence[float]) -> np.ndarray:
    """Per request, how many others had arrived before it and not yet finished (what the gateway
    counts in flight when it arrives), from a run's records."""
    a = np.asarray(arrival, dtype=float)
    f = np.asarray(finish, dtype=float)
    order = np.argsort(a, kind="stable")
    started = np.arange(len(a))  # requests that arrived before each, in arrival order
    ended = np.searchsorted(np.sort(f), a[order], side="right")  # requests finished by its arrival
    out = np.empty(len(a), dtype=int)
    out[order] = started - ended
    return np.maximum(out, 0)
