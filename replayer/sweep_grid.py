"""The grid of ``gpuhit sweep``: its points, what each axis does to a replay, and the Zipf redraw.

A :class:`Point` names one value per axis (None: ``gpuhit replay``'s default). Kept apart from the
command (:mod:`replayer.cli_sweep`), which plans, runs and reports the points, so what a point means
(the engine options a KV size gives, the trace a skew draws) reads on its own and is tested alone.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from typing import Any

from gpuhit.errors import ConfigError

GIB = 1 << 30
ZIPF_DRAW_SEED = 0
# The *GPU-Hit-First* note's lpwl_migrate thresholds around its defaults (32768 tokens, 30 s): 4x lower and higher.
MIGRATE_T_HOT = (8192, 32768, 131072)
MIGRATE_T_COOL = (10.0, 30.0, 120.0)


@dataclass(frozen=True, slots=True)
class Point:
    """One grid point; None on an axis = replay's default."""

    rate: float | None
    kv_gib: float | None
    zipf: float | None
    replicas: int | None = None

    @property
    def name(self) -> str:
        parts = [f"rate{self.rate:g}" if self.rate is not None else "",
                 f"kv{self.kv_gib:g}GiB" if self.kv_gib is not None else "",
                 f"zipf{self.zipf:g}" if self.zipf is not None else "",
                 f"replicas{self.replicas}" if self.replicas is not None else ""]
        return "_".join(x for x in parts if x) or "default"

    @property
    def trace_key(self) -> str:
        return "" if self.zipf is None else f"zipf{self.zipf!r}"

    def axes(self) -> dict[str, float | None]:
        axes: dict[str, float | None] = {"rate": self.rate, "kv_gib": self.kv_gib, "zipf": self.zipf}
        if self.replicas is not None:  # the replicas axis only in sweeps that have it
            axes["replicas"] = self.replicas
        return axes


def _floats(text: str | None, flag: str, *, positive: bool) -> list[float | None]:
    if text is None:
        return [None]
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not vals:
        raise ConfigError(f"{flag} is empty")
    for v in vals:
        if not math.isfinite(v) or (v <= 0 if positive else v < 0):
            raise ConfigError(f"{flag} values must be {'> 0' if positive else '>= 0'}, got {v:g}")
    if len(set(vals)) != len(vals):
        raise ConfigError(f"{flag} repeats a value: {text}")
    return list(vals)


def grid(args: argparse.Namespace) -> list[Point]:
    """The grid points, axes in the order rate, KV, skew, replicas."""
    rates = _floats(args.rates, "--rates", positive=True)
    kvs = _floats(args.kv_gib, "--kv-gib", positive=True)
    zipfs = _floats(args.zipf, "--zipf", positive=False)
    reps: list[int | None] = [None]
    if getattr(args, "replicas", None) is not None:
        vals = _floats(args.replicas, "--replicas", positive=True)
        if any(v != int(v) for v in vals if v is not None):
            raise ConfigError(f"--replicas must be whole numbers, got {args.replicas!r}")
        reps = [int(v) for v in vals if v is not None]
    return [Point(r, k, z, n) for r, k, z, n in itertools.product(rates, kvs, zipfs, reps)]


def migrate_policies() -> list[dict[str, Any]]:
    """lpwl, and lpwl_migrate over :data:`MIGRATE_T_HOT` x :data:`MIGRATE_T_COOL`."""
    out: list[dict[str, Any]] = [{"name": "lpwl", "type": "lpwl", "params": {}}]
    for hot, cool in itertools.product(MIGRATE_T_HOT, MIGRATE_T_COOL):
        out.append({"name": f"lpwl_migrate[hot={hot},cool={cool:g}]", "type": "lpwl_migrate",
                    "params": {"t_hot_tokens": hot, "t_cool_s": cool}})
    return out


def zipf_resample(trace: Any, alpha: float, n: int, *, seed: int = ZIPF_DRAW_SEED) -> Any:
    """``n`` conversations drawn from ``trace``'s root sessions with P(rank k) ~ k^-alpha.

    Rank = replay order (:func:`replayer.arrivals.roots`). Draw i copies the chosen conversation and
    its sub-agents under new ids (``<id>~<i>``) in the same hash namespace, at the i-th root's
    recorded arrival (sub-agents keep their offset to their parent).
    """
    import dataclasses

    import numpy as np

    from replayer.arrivals import children_index, roots
    from replayer.trace import Trace

    rs = roots(trace)
    if not rs:
        raise ConfigError("the trace holds no root sessions to draw from")
    if n <= 0:
        raise ConfigError("a Zipf draw needs at least one session")
    w = np.arange(1, len(rs) + 1, dtype=float) ** -float(alpha)
    picks = np.random.default_rng(seed).choice(len(rs), size=n, p=w / w.sum())
    kids = children_index(trace)
    out = []
    for i, k in enumerate(picks):
        root = rs[int(k)]
        shift = rs[i % len(rs)].arrival - root.arrival
        stack = [(root, None)]
        while stack:
            s, parent = stack.pop()
            sid = f"{s.session_id}~{i}"
            out.append(dataclasses.replace(s, session_id=sid, parent=parent, arrival=s.arrival + shift))
            stack.extend((c, sid) for c in reversed(kids.get(s.session_id, ())))
    return Trace(name=f"{trace.name}+zipf{alpha:g}", format=trace.format, sessions=tuple(out),
                 hash_scope=trace.hash_scope, source=trace.source)


def engine_kwargs(point: Point, profile_name: str, block_size: int) -> tuple[dict[str, Any], str | None]:
    """Engine options for the point's KV capacity, and a note when max_model_len had to shrink."""
    if point.kv_gib is None:
        return {}, None
    from engines.emulated.profile import load_profile

    prof = load_profile(profile_name)
    cap = point.kv_gib * GIB
    fit = (prof.num_gpu_blocks(block_size, cap) - 1) * block_size
    if fit < block_size:
        raise ConfigError(f"--kv-gib {point.kv_gib:g} holds no {block_size}-token block of {profile_name}")
    kw: dict[str, Any] = {"kv_capacity_bytes": cap}
    if fit < prof.max_model_len:
        kw["max_model_len"] = fit
        return kw, (f"{point.name}: max_model_len {prof.max_model_len} -> {fit} (what {point.kv_gib:g} GiB holds); "
                    "longer prompts are rejected")
    return kw, None


def describe(pt: Point) -> str:
    parts = []
    if pt.rate is not None:
        parts.append(f"rate {pt.rate:g} sessions/s")
    if pt.kv_gib is not None:
        parts.append(f"KV {pt.kv_gib:g} GiB per instance")
    if pt.zipf is not None:
        parts.append(f"Zipf alpha {pt.zipf:g}")
    if pt.replicas is not None:
        parts.append(f"{pt.replicas} gateway replica{'s' if pt.replicas > 1 else ''}")
    return ", ".join(parts) or "replay defaults"


__all__ = ["Point", "describe", "engine_kwargs", "grid", "migrate_policies", "zipf_resample"]
