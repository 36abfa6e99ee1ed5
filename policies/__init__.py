"""Routing policies: pure functions of a frozen :class:`policies.snapshot.Snapshot`.

Every policy module registers itself in :mod:`policies.registry`; build one with
``policies.registry.build({"name": ..., "type": ..., "params": {...}})`` or ``build("lpwl")``.
"""
