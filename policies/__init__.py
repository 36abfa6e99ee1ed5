"""Routing policies: pure functions of a frozen :class:`policies.snapshot.Snapshot`.

Every policy module registers itself in :mod:`policies.registry`; build one with
``policies.registry.build({"name": ..., "type": ..., "params": {...}})`` or ``build("lpwl")``.
"""

# Some of this package's modules may be compiled (``make compile``, :mod:`gpuhit.native`): a stale or
# partial build is refused here, before any of them is imported.
from gpuhit import native as _native

_native.check_once()
