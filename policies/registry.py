"""The one registry of routing policies.

A policy *type* is registered once with :func:`register` (a duplicate name raises). A policy is
configured as ``{"name": str, "type": str, "params": {...}}`` (or just the type name) and built by
:func:`build`, which validates the params. Built policies are immutable and expose
``decide(snapshot) -> Decision``: no I/O, no awaiting, no clock beyond ``snapshot.now``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpuhit.errors import ConfigError
from policies.snapshot import Decision, Snapshot


class Policy(Protocol):
    """``decide`` maps a frozen snapshot to a decision. A policy may set a class attribute
    ``reads_prefix_hits = False`` to declare it never reads ``gpu_hit_blocks``/``cpu_hit_blocks``:
    the router then leaves them 0 in its snapshots (saving a KV-index match per instance) and
    looks up only the chosen instances' hits for its accounting. Likewise ``reads_engine_stats =
    False`` declares it never reads the engines' ``running``/``waiting``/``kv_usage``/
    ``capacity_blocks``: the router then leaves them None (unknown) instead of asking every engine
    per decision. ``reads_residency = True`` and ``reads_prefill_work = True`` ask for what is
    otherwise left 0: the resident working sets, and the queued prefill work (which the gateway then
    prices for every request it routes)."""

    # Read-only (policies are frozen dataclasses): properties, so a frozen field satisfies them.
    @property
    def name(self) -> str: ...

    @property
    def type(self) -> str: ...

    def decide(self, snapshot: Snapshot) -> Decision: ...


Factory = Callable[[str, Mapping[str, Any]], Policy]

_REGISTRY: dict[str, Factory] = {}
# Modules that register policy types; imported lazily on first lookup so importing the registry
# stays cheap and import cycles cannot bite.
_POLICY_MODULES: tuple[str, ...] = (
    "policies.adaptive",
    "policies.baselines",
    "policies.cache_aware",
    "policies.lpwl",
    "policies.pd",
    "policies.resident",
    "policies.route_query",
)
_loaded = False


def register(type_name: str) -> Callable[[Factory], Factory]:
    def deco(factory: Factory) -> Factory:
        if type_name in _REGISTRY:
            raise ConfigError(f"policy type {type_name!r} registered twice")
        _REGISTRY[type_name] = factory
        return factory

    return deco


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _POLICY_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:  # a real import error inside the module must surface
                raise


def available() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def build(config: str | Mapping[str, Any]) -> Policy:
    """Build a policy from a type name or a ``{name, type, params}`` mapping."""
    _load()
    if isinstance(config, str):
        config = {"name": config, "type": config, "params": {}}
    if not isinstance(config, Mapping):
        raise ConfigError(f"policy config must be a name or a mapping, got {type(config).__name__}")
    unknown = set(config) - {"name", "type", "params"}
    if unknown:
        raise ConfigError(f"unknown policy config keys {sorted(unknown)}; expected name, type, params")
    ptype = config.get("type") or config.get("name")
    if not isinstance(ptype, str) or ptype not in _REGISTRY:
        raise ConfigError(f"unknown policy {ptype!r}; available: {', '.join(available())}")
    params = config.get("params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"policy params must be a mapping, got {type(params).__name__}")
    return _REGISTRY[ptype](str(config.get("name") or ptype), params)
