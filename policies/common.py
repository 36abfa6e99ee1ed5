"""Helpers shared by the policy modules: parameter validation and candidate selection.

Every policy is a frozen dataclass built by a registered factory ``(name, params) -> policy``;
:func:`parse_params` turns a user's params mapping into checked keyword arguments (unknown key,
wrong type or out-of-range value -> :class:`~gpuhit.errors.ConfigError` naming the policy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuhit.errors import ConfigError, NoInstanceError
from policies.snapshot import InstanceState, Snapshot


@dataclass(frozen=True, slots=True)
class Param:
    """One accepted parameter: its kind ("int" | "float" | "str" | "bool"), default and check."""

    kind: str
    default: Any
    check: Callable[[Any], bool] | None = None
    help: str = ""


def parse_params(ptype: str, params: Mapping[str, Any], spec: Mapping[str, Param]) -> dict[str, Any]:
    unknown = sorted(set(params) - set(spec))
    if unknown:
        accepted = ", ".join(sorted(spec)) or "none"
        raise ConfigError(f"policy {ptype!r}: unknown params {unknown}; accepted: {accepted}")
    out: dict[str, Any] = {}
    for key, p in spec.items():
        if key not in params:
            out[key] = p.default
            continue
        v = params[key]
        if v is None and p.default is None:  # an optional param explicitly left unset
            out[key] = None
            continue
        try:
            if p.kind == "int":
                if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
                    raise TypeError
                v = int(v)
            elif p.kind == "float":
                if isinstance(v, bool):
                    raise TypeError
                v = float(v)
            elif (p.kind == "str" and not isinstance(v, str)) or (p.kind == "bool" and not isinstance(v, bool)):
                raise TypeError
        except (TypeError, ValueError):
            raise ConfigError(f"policy {ptype!r}: param {key!r} must be a {p.kind}, got {v!r}") from None
        if p.check is not None and not p.check(v):
            raise ConfigError(f"policy {ptype!r}: param {key!r} = {v!r} is out of range ({p.help})")
        out[key] = v
    return out


def healthy(snapshot: Snapshot, pool: Iterable[int] | None = None) -> list[InstanceState]:
    """Healthy instances (optionally within ``pool``), in index order; NoInstanceError if none."""
    insts = snapshot.instances
    out = [s for s in (insts if pool is None else [insts[i] for i in pool]) if s.healthy]
    if not out:
        raise NoInstanceError("no healthy instance can take the request")
    return out


def new_prefill_tokens(snapshot: Snapshot, inst: InstanceState) -> int:
    """``input - GPU hit`` tokens this request would prefill on ``inst``."""
    return snapshot.request.input_tokens - snapshot.hit_tokens(inst.index)


def tie_key(s: InstanceState) -> tuple[int, int, int]:
    """The shared tie-break after a policy's own score: fewer in-flight requests, then fewer
    requests routed here so far, then lower index.

    A pure function of the snapshot. Lowest-index-only ties left healthy instances idle while others
    queued (an instance done with its prefill but still decoding scores like an idle one on
    prefill-only scores, and index 0 kept winning); the in-flight and routed counts send a tie to the
    instance with the least to do, and among equally idle ones to the least used.
    """
    return (s.in_flight, s.routed, s.index)


def fmt(x: float) -> str:
    return f"{x:.6g}"
