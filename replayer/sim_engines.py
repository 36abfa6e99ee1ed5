"""The engines of a simulated run: how they are built, and what is read off them afterwards.

:func:`emulated_factory` builds the emulated vLLM engines of one run (one profile loaded once, one
in-process KV transfer registry shared by them: :func:`new_registry`); a test or a study can pass
its own factory of the same shape (:data:`EngineFactory`). :func:`busy_time` and
:func:`engine_series` read an engine's busy seconds and its own utilization series, for the run's
utilization summary and plot (:func:`replayer.simulate.simulate`). Apart from the simulation loop
because they are the part that knows engines' attributes; the loop only drives them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from engines.base import EngineClient

EngineFactory = Callable[[str, int, Any], EngineClient]  # (name, index, transfer registry) -> engine


def busy_time(engine: Any) -> float | None:
    """Cumulative busy seconds of an engine (None = the engine does not report it)."""
    m = getattr(engine, "metrics", None)
    if m is not None and isinstance(getattr(m, "busy_s", None), (int, float)):
        return float(m.busy_s)
    v = getattr(engine, "busy_time", None)
    if v is not None:
        return float(v() if callable(v) else v)
    return None


def engine_series(engine: Any, now: float, t0: float) -> tuple[list[float], list[float]] | None:
    """The engine's own binned busy-fraction series, relative to ``t0`` (None = not provided)."""
    m = getattr(engine, "metrics", None)
    fn = getattr(m, "utilization_series", None)
    if fn is None:
        return None
    pts = fn(now)
    return [t - t0 for t, _ in pts], [u for _, u in pts]


def emulated_factory(profile: str, engine_kwargs: Mapping[str, Any] | None = None,
                     util_bin_s: float | None = None, block_ids: str = "vllm", seed: int = 0) -> EngineFactory:
    """Factory of :class:`engines.emulated.EmulatedEngine` instances sharing one transfer registry.
    ``block_ids``: the identity of the block hashes the engines will be sent ("chain": the
    synthesizer's chain ids, which the engines' block pools keep in numpy pages). ``seed``: the
    run's, from which each engine of a profile with ``stalls`` seeds its own draws."""
    from engines.emulated.engine import EmulatedEngine as Engine
    from engines.emulated.profile import load_profile

    prof = load_profile(profile)  # once per run, not per engine; unknown names raise ConfigError
    kwargs = dict(engine_kwargs or {})
    params = inspect.signature(Engine).parameters
    if "emit_token_ids" in params:
        # The simulation sends block hashes, not token ids: nothing to put into BlockStored events.
        kwargs.setdefault("emit_token_ids", False)
    if util_bin_s is not None and "util_bin_s" in params:
        kwargs.setdefault("util_bin_s", util_bin_s)
    if block_ids != "vllm":
        kwargs.setdefault("block_ids", block_ids)

    # engines of a profile measured on a shared host share one, consecutive ones as many as it held;
    # a table of 1.0 only (engines that do not slow each other) leaves them apart, decode jumps and all
    # (a profile with host_cpu: as many as its model's shares, timed by the host's CPU demand)
    hosts: dict[int, Any] = {}
    per_host = len(prof.host_contention) if any(f != 1.0 for f in prof.host_contention) else 0
    if prof.host_cpu is not None:  # steps on accelerators (engine_cores 0): no host, decode jumps kept
        per_host = prof.host_cpu.engines if prof.host_cpu.engine_cores > 0 else 0

    def make(name: str, index: int, registry: Any) -> EngineClient:
        kw = dict(kwargs)
        if registry is not None and "transfer_registry" in params:
            kw["transfer_registry"] = registry
        if per_host and "host" in params:
            from engines.emulated.shared_host import SharedHost

            if index // per_host not in hosts:
                hosts[index // per_host] = SharedHost(prof.host_contention, prof.host_cpu)
            kw.setdefault("host", hosts[index // per_host])
        if prof.stalls is not None and "stalls" in params:
            kw.setdefault("stalls", prof.stalls.sampler(f"{seed}/{index}"))
        return Engine(name, prof, **kw)

    return make


def new_registry() -> Any:
    """The in-process KV transfer registry the engines of one simulation share (PD, migration)."""
    from engines.emulated.kv_transfer import TransferRegistry

    return TransferRegistry()
