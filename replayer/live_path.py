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

Where the path's growth under load is paid: at the **first chunk**, not on the way in. Measured on
the real pair (``analysis/results/live-path-loaded-2026-11-27.md``): a lone prompt answered with one
token pays a 3 ms path, the same prompt asked for 16 tokens, one at a time through the gateway, ~30
ms, and its finish no later than the engine's own timings allow (client end-to-end minus vLLM's TTFT
is its 15 decode steps). vLLM's API server relays a request's outputs as a stream of deltas, merged
while it lags behind the engine; while the engine keeps decoding, the API server waits for a core
and the first chunk leaves late, and the later ones catch up. So the simulator takes the lone pairs'
gateway addition as a delay where the request crosses the gateway (:class:`replayer.simulate.SimTarget`),
and the measured path under load beyond the lone one (:func:`first_chunk_lag`) as a delay of each
request's first token as the client sees it, never past its finish (:func:`delay_first_chunks`):
the engines see the request when they would have, and the client's next turn waits for the finish,
as live.

The profile's frontend delay (``frontend_overhead_s``, fitted on lone probes sent straight to the
engine) already holds the direct client's path; both delays are what the path adds beyond it.
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
        return _beyond(rows, direct)
    gw = float(lp.get("gateway_ttft_s", math.nan))
    if math.isfinite(gw):
        return LivePathModel(((0, max(gw, 0.0)),))
    return None


def first_chunk_lag(live_path: Mapping[str, Any] | None) -> LivePathModel | None:
    """The first chunk's lag per in-flight count: the path measured under load
    (``fit.live_path.by_in_flight``) beyond the lone direct path and the lone gateway addition (which
    the frontend delay and the crossing of the gateway already hold); below them (noise) counts as 0.
    None when the fit did not measure the path under load."""
    lp = live_path or {}
    direct = float(lp.get("direct_path_s", math.nan))
    rows = lp.get("by_in_flight") or []
    if not rows or not math.isfinite(direct):
        return None
    gw = float(lp.get("gateway_ttft_s", 0.0))
    base = direct + (max(gw, 0.0) if math.isfinite(gw) else 0.0)
    return _beyond(rows, base)


def _beyond(rows: Sequence[Mapping[str, Any]], base: float) -> LivePathModel:
    """The model of the measured ``by_in_flight`` rows less ``base`` seconds (below it counts as 0)."""
    return LivePathModel(tuple(sorted((float(r["in_flight"]), max(float(r["path_s"]) - base, 0.0)) for r in rows)))


def delay_first_chunks(records: Sequence[Any], lag: LivePathModel, whole: bool = False, stalls: Any = None,
                       seed: int = 0) -> np.ndarray:
    """Delay each answered request's first token (as the client sees it) by ``lag`` at the count of
    others in flight when it arrived, never past its finish; in place. The delays applied, per
    answered request in ``records``' order.

    ``whole``: the finish by the same delay too (the response shifted whole, first chunk uncapped).
    Why both exist: a lone 16-token request's later chunks catch up with the engine, but during a
    run's load, with answers of a few tokens, the client's end-to-end exceeded vLLM's own by about
    the TTFT path (``analysis/results/live-host-2026-11-27.md``): the lag held to the last chunk.

    ``stalls``: a profile's :class:`~engines.emulated.stalls.Stalls` with path stalls: each request's
    lag is then the lag less their mean plus a draw (:meth:`~engines.emulated.stalls.StallSampler.path`),
    drawn in records' order from ``seed`` (the run's)."""
    ok = [r for r in records if not r.error and math.isfinite(r.first_token)]
    k = in_flight_at_arrival([r.arrival for r in ok], [r.finish for r in ok])
    applied = np.empty(len(ok))
    draw = stalls.sampler(f"path/{seed}").path if stalls is not None and stalls.path_p > 0 else None
    for i, (r, n) in enumerate(zip(ok, k)):
        d = lag(int(n))
        if draw is not None:
            d = draw(d)
        new = r.first_token + d if whole else min(r.first_token + d, r.finish)
        applied[i] = new - r.first_token
        r.first_token = new
        if whole:
            r.finish += d
    return applied


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


LIVE_PATH_MODES = ("in-flight", "response", "split", "constant", "none")
WHOLE_RESPONSE = ("response", "split")  # the modes whose lag shifts the whole response (first chunk and finish)


def path_models(profile: Any, mode: str = "in-flight") -> tuple[Any, Any, dict[str, Any]]:
    """The live-path models a simulation applies, from a profile's ``fit.live_path`` and a
    ``--live-path`` mode: the delay where a request crosses the gateway (the lone pairs' addition;
    None for ``none`` or a profile that never measured it), the lag per in-flight count
    (``in-flight``: of the first chunk, ``response``: of the whole response, :func:`delay_first_chunks`;
    None otherwise or where the fit did not measure the path under load), and their summary:
    ``{"mode", "direct_s", "gateway_s", "points": [[in_flight, extra_s], ...]}`` (the two delays
    together; ``direct_s`` nan where not measured).

    ``split``: the path under load placed where the engine spans put it, the share ``before_share`` of
    ``fit.live_path`` (the path's mean before the engine over its mean before and after,
    :func:`replayer.gap_split.before_share`) on the way in, where the request crosses the gateway, the
    rest on the whole response; ``response`` puts all of it on the response (the engine meets the
    request as early as a lone one)."""
    if mode not in LIVE_PATH_MODES:
        raise ConfigError(f"--live-path must be one of {', '.join(LIVE_PATH_MODES)}, got {mode!r}")
    lp = (profile.fit or {}).get("live_path") or {}
    ingress = None if mode == "none" else from_fit(lp, by_in_flight=False)
    lag = first_chunk_lag(lp) if mode in ("in-flight", *WHOLE_RESPONSE) else None
    gw = ingress(0) if ingress is not None else 0.0
    points = [[k, gw + s] for k, s in lag.points] if lag is not None else ([[0, gw]] if ingress is not None else [])
    share = None
    if mode == "split" and lag is not None:
        share = lp.get("before_share")
        if share is None or not 0.0 <= float(share) <= 1.0:
            raise ConfigError("--live-path split needs the share of the path before the engine, fit.live_path."
                              f"before_share in [0, 1], measured from engine spans; the profile has {share!r}")
        share = float(share)
        ingress = LivePathModel(tuple((k, gw + share * s) for k, s in lag.points))
        lag = LivePathModel(tuple((k, (1.0 - share) * s) for k, s in lag.points))
    return ingress, lag, {"mode": mode if lag is not None else ("constant" if ingress is not None else "none"),
                          **({"before_share": share} if share is not None else {}),
                          "direct_s": float(lp.get("direct_path_s", math.nan)), "gateway_s": gw, "points": points}
