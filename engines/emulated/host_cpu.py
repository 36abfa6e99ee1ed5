"""A host's CPUs as one shared resource: how much a step slows down when the host's CPU demand
exceeds its cores.

Why a demand model and not a constant factor: engines of vLLM's CPU build bound to their own cores
share the host with everything else that needs a core at that moment: each engine's API server
(HTTP, input processing, detokenizing and streaming each output token), the gateway, the client,
the engines' own unpinned threads. A factor measured once, with one request per engine, is an
average over whatever that demand was then; it cannot follow a run whose streams come and go. Here
the demand is computed at each step from what is in flight, in the units ``gpuhit profile fit``
measures from CPU seconds (``replayer/calibrate_cpu.py``)::

    floating = idle_cores                                   # scrapes, loggers: paid without requests
             + busy_extra_cores * busy engines              # an engine's unpinned threads while it works
             + per_request_s * requests arriving per second # parse, input processing, the final answer
             + per_token_s * tokens produced per second     # detokenize, serialize, relay each token
    overflow = engine_cores * busy engines + floating - cores

With no overflow the floating work fits on idle cores and a step takes its profile time. Otherwise
the overflow lands on the busy engines' cores (a processor-sharing core gives its pinned engine
``engine_cores / (engine_cores + x)`` of itself while ``x`` cores of other work share it), split by
each engine's measured ``share`` (the floating processes do not land evenly: the kernel places them
on some cores more than others), so the step of engine ``e`` lasts ``1 + overflow * s_e /
engine_cores`` times its profile time.

On an accelerator host the engine's step runs on its device: ``engine_cores`` is 0 and every step
takes its profile time whatever the CPU demand (``cores`` the host's CPUs, the frontends' demand far
below them, gives the same). The request rate is counted over the last ``window_s`` seconds of
arrivals (a request's own CPU work is milliseconds, spread here over the window it falls in); the
token rate is each busy engine's tokens per step over its last step's time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuhit.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HostCPU:
    """The measured CPU costs of one host's engines and their frontends (see module docstring)."""

    cores: float
    engine_cores: float = 1.0
    busy_extra_cores: float = 0.0
    idle_cores: float = 0.0
    per_request_s: float = 0.0
    per_token_s: float = 0.0
    share: tuple[float, ...] = ()
    window_s: float = 1.0

    def __post_init__(self) -> None:
        nums = (self.cores, self.engine_cores, self.busy_extra_cores, self.idle_cores, self.per_request_s,
                self.per_token_s, self.window_s, *self.share)
        if not all(math.isfinite(x) and x >= 0 for x in nums) or self.cores <= 0 or self.window_s <= 0:
            raise ConfigError(f"host_cpu needs finite, non-negative costs, positive cores and window: {self}")
        if len(self.share) < 1:
            raise ConfigError("host_cpu's share needs one entry per engine on the host")

    @property
    def engines(self) -> int:
        """How many engines share the host (one share each)."""
        return len(self.share)

    def floating_cores(self, busy: int, request_rate: float, token_rate: float) -> float:
        """The CPU demand not pinned to an engine's cores, in cores."""
        return (self.idle_cores + self.busy_extra_cores * busy + self.per_request_s * request_rate
                + self.per_token_s * token_rate)

    def factor(self, engine: int, busy: Sequence[int], request_rate: float, token_rate: float) -> float:
        """Step-time factor of engine index ``engine`` while the engines ``busy`` (indices, ``engine``
        among them) work and the host sees ``request_rate`` arrivals and ``token_rate`` tokens per s."""
        if self.engine_cores <= 0:
            return 1.0  # the step runs on an accelerator: the host's CPUs do not time it
        over = self.engine_cores * len(busy) + self.floating_cores(len(busy), request_rate, token_rate) - self.cores
        if over <= 0:
            return 1.0
        total = sum(self.share[b] for b in busy)
        s = self.share[engine] / total if total > 0 else 1.0 / len(busy)
        return 1.0 + over * s / self.engine_cores

    def to_json(self) -> dict[str, Any]:
        return {"cores": self.cores, "engine_cores": self.engine_cores, "busy_extra_cores": self.busy_extra_cores,
                "idle_cores": self.idle_cores, "per_request_s": self.per_request_s, "per_token_s": self.per_token_s,
                "share": list(self.share), "window_s": self.window_s}


def host_cpu_of(d: Any, where: str) -> HostCPU:
    """``host_cpu`` as a profile file writes it (:meth:`HostCPU.to_json`); unknown keys are refused."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: host_cpu must be an object, got {d!r}")
    known = set(HostCPU.__dataclass_fields__)
    unknown = set(d) - known
    if unknown or "cores" not in d or "share" not in d:
        raise ConfigError(f"{where}: host_cpu needs cores and share and takes only {sorted(known)}; "
                          f"got {sorted(d)}")
    try:
        kw = {k: (tuple(float(x) for x in v) if k == "share" else float(v)) for k, v in d.items()}
        return HostCPU(**kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: host_cpu: {exc}") from None
