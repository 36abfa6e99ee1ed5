"""Where each request's prefix is cached: per instance, GPU prefix hit and CPU-tier extension, in blocks.

One interface (:class:`KVIndex`), two sources:

* :class:`PreciseKVIndex` follows the engines' KV events (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``, per medium; a ``None`` medium means GPU, as in vLLM).
* :class:`ApproximateKVIndex` learns only from the gateway's own routing: every routed request's
  blocks are assumed cached on its instance, with an LRU per instance sized from the engine's
  capacity in blocks (for engines that publish no events).

Speed: each instance's blocks in each medium are a tier (:mod:`gateway.kv_tiers`), whose prefix
hit is a binary search over the chain's positions, verified: the precise index's tiers are plain
sets of hashes (:class:`~gateway.kv_tiers.ChainTier`), the approximate index's keep each block's
parent, for its LRU and its orphan count (:class:`~gateway.kv_tiers.ParentedTier`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from engines.kv_events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gateway.kv_tiers import ChainTier, ParentedTier, Tier, as_ints
from gpuhit.errors import ConfigError


class KVIndex(Protocol):
    """Per-instance prefix-hit oracle the router consults for every request. An index may set
    ``learns_from_routing = False`` when :meth:`on_routed` does nothing (the router then skips the
    call for forwards); without the attribute it is called."""

    num_instances: int

    def match(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        """Per instance: (GPU prefix-hit blocks, CPU-tier blocks continuing the prefix beyond it)."""
        ...

    def match_one(self, instance: int, block_hashes: Sequence[int]) -> tuple[int, int]:
        """``match(block_hashes)[instance]``, without looking at the other instances."""
        ...

    def on_kv_event(self, instance: int, batch: KVEventBatch) -> None: ...

    def on_routed(self, instance: int, block_hashes: Sequence[int]) -> None: ...

    def cached(self, instance: int, medium: str = GPU) -> set[int]:
        """The block hashes believed cached on ``instance`` in ``medium`` (tests / debug)."""
        ...


def _hit(g_set: Tier, c_set: Tier, hashes: Sequence[int]) -> tuple[int, int]:
    """One instance's (GPU prefix hit, CPU-tier blocks continuing it)."""
    g = g_set.prefix_hit(hashes) if g_set.blocks else 0
    return (g, c_set.prefix_hit(hashes, g) if c_set.blocks else 0)


class _BaseIndex:
    __slots__ = ("_cpu", "_gpu", "num_instances")

    def __init__(self, num_instances: int, lru: bool = False):
        if num_instances <= 0:
            raise ConfigError(f"a KV index needs at least one instance, got {num_instances}")
        self.num_instances = num_instances
        self._gpu: list[Tier] = [ParentedTier(lru) for _ in range(num_instances)]
        self._cpu: list[Tier] = [ParentedTier() for _ in range(num_instances)]

    def _check(self, instance: int) -> None:
        if not 0 <= instance < self.num_instances:
            raise ConfigError(f"instance {instance} out of range 0..{self.num_instances - 1}")

    def match(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        if not block_hashes:
            return [(0, 0)] * self.num_instances
        out = []
        for g_set, c_set in zip(self._gpu, self._cpu):  # _hit per instance, inline (per request)
            g = g_set.prefix_hit(block_hashes) if g_set.blocks else 0
            out.append((g, c_set.prefix_hit(block_hashes, g) if c_set.blocks else 0))
        return out

    def match_one(self, instance: int, block_hashes: Sequence[int]) -> tuple[int, int]:
        self._check(instance)
        if not block_hashes:
            return (0, 0)
        return _hit(self._gpu[instance], self._cpu[instance], block_hashes)

    def cached(self, instance: int, medium: str = GPU) -> set[int]:
        self._check(instance)
        sets = self._gpu if medium in (GPU, None) else self._cpu if medium == CPU else None
        if sets is None:
            raise ConfigError(f"unknown medium {medium!r}; the index tracks GPU and CPU")
        return set(sets[instance].blocks)


class PreciseKVIndex(_BaseIndex):
    """Index fed by the engines' KV events (the router subscribes it to every engine).

    Media other than GPU and CPU (e.g. ``STORAGE``, a shared remote store) are ignored: a remote
    store is not a property of one instance's prefix hit.
    """

    __slots__ = ()
    learns_from_routing = False  # on_routed is a no-op: the router skips calling it

    def __init__(self, num_instances: int, new_set: Callable[[], Any] | None = None):
        """``new_set``: makes each tier's empty set of hashes (default ``set``; the gateway passes the
        C speedups' ``BlockSet`` when it uses them)."""
        super().__init__(num_instances)
        self._gpu = [ChainTier(new_set) for _ in range(num_instances)]
        self._cpu = [ChainTier(new_set) for _ in range(num_instances)]

    def reserve(self, gpu_blocks: Sequence[int | None]) -> None:
        """Size each instance's GPU tier for its engine's capacity in blocks (None: unknown, left to
        grow), so a cache filling up does not rehash the index mid-request (see :meth:`ChainTier.reserve`)."""
        for tier, n in zip(self._gpu, gpu_blocks):
            if n and isinstance(tier, ChainTier):
                tier.reserve(n)

    def on_kv_event(self, instance: int, batch: KVEventBatch) -> None:
        self._check(instance)
        gpu = self._gpu[instance]
        cpu = self._cpu[instance]
        # vLLM publishes one BlockRemoved per evicted block (the emulator one per allocation), so a
        # batch is mostly long runs of removals: a run on one medium is collected and applied in one call.
        run: list[int] = []
        extend = run.extend
        run_target: Tier | None = None
        for ev in batch.events:
            if isinstance(ev, BlockRemoved):
                m = ev.medium
                target = gpu if (m == GPU or m is None) else cpu if m == CPU else None
                if target is None:
                    continue
                if target is not run_target:
                    if run and run_target is not None:
                        run_target.remove_many(run)
                        run.clear()
                    run_target = target
                hs = ev.block_hashes
                extend(hs if type(hs) is tuple else as_ints(hs))
                continue
            if run and run_target is not None:
                run_target.remove_many(run)
                run.clear()
            if isinstance(ev, BlockStored):
                target = self._tier(instance, ev.medium)
                if target is not None:
                    target.add_chain(ev.block_hashes, ev.parent_block_hash)
            elif isinstance(ev, AllBlocksCleared):
                if ev.medium in (None, GPU):
                    gpu.clear()
                if ev.medium in (None, CPU):
                    cpu.clear()
            else:  # the decoder only produces the three types; anything else is a bug upstream
                raise ConfigError(f"unknown KV event {type(ev).__name__}")
        if run and run_target is not None:
            run_target.remove_many(run)

    def on_routed(self, instance: int, block_hashes: Sequence[int]) -> None:
        """Nothing to learn: the engine's events are the truth."""

    def _tier(self, instance: int, medium: str | None) -> Tier | None:
        if medium is None or medium == GPU:
            return self._gpu[instance]
        if medium == CPU:
            return self._cpu[instance]
        return None


class ApproximateKVIndex(_BaseIndex):
    """Index learned from routing: a routed request's blocks are assumed cached on its instance.

    Each instance keeps an LRU of at most ``capacities[i]`` blocks. A routed chain is touched tail
    first so its head ends most recent: eviction then takes tails first, as vLLM does, and the
    cached set stays prefix-closed. KV events are ignored (use :class:`PreciseKVIndex` for those).
    """

    __slots__ = ("capacities",)

    def __init__(self, capacities: Sequence[int]):
        super().__init__(len(capacities), lru=True)
        caps = [int(c) for c in capacities]
        if any(c <= 0 for c in caps):
            raise ConfigError(f"approximate KV index capacities must be positive blocks, got {caps}")
        self.capacities = caps

    @classmethod
    def from_engines(cls, engines: Iterable[object]) -> ApproximateKVIndex:
        """Size each LRU from ``engine.stats().kv_capacity_blocks`` (must be known)."""
        caps = []
        for eng in engines:
            cap = eng.stats().kv_capacity_blocks  # type: ignore[attr-defined]
            if not cap:
                raise ConfigError(
                    f"engine {getattr(eng, 'name', '?')!r} does not report its KV capacity in blocks; "
                    "give the approximate index explicit capacities"
                )
            caps.append(cap)
        return cls(caps)

    def on_kv_event(self, instance: int, batch: KVEventBatch) -> None:
        """Ignored: this index models engines that publish no events."""

    def on_routed(self, instance: int, block_hashes: Sequence[int]) -> None:
        self._check(instance)
        s = self._gpu[instance]
        blocks = s.blocks
        n = len(block_hashes)
        for j in range(n - 1, -1, -1):
            h = block_hashes[j]
            if h in blocks:
                blocks.move_to_end(h)
            else:
                s.add(h, block_hashes[j - 1] if j else None)
        cap = self.capacities[instance]
        while len(blocks) > cap:
            oldest = next(iter(blocks))
            s.remove(oldest)
