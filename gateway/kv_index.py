"""Where each request's prefix is cached: per instance, GPU prefix hit and CPU-tier extension, in blocks.

One interface (:class:`KVIndex`), two sources:

* :class:`PreciseKVIndex` follows the engines' KV events (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``, per medium; a ``None`` medium means GPU, as in vLLM).
* :class:`ApproximateKVIndex` learns only from the gateway's own routing: every routed request's
  blocks are assumed cached on its instance, with an LRU per instance sized from the engine's
  capacity in blocks (for engines that publish no events).

Speed. Agentic prompts are ~6,500 blocks, so a linear prefix scan per instance per request is too
slow. vLLM block hashes are chained (a block's hash covers its whole prefix) and vLLM frees a
request's blocks tail first, so an instance's cached blocks of one chain are almost always
prefix-closed: cached up to some position, absent after. :meth:`_BlockSet.prefix_hit` therefore
binary-searches the chain positions (O(log n) dict probes). Exactness is kept by bookkeeping, not
hope: each set tracks its *orphans*, stored blocks whose parent is not stored. A hole inside the
searched range implies an orphan in it, so when a set has no orphans the binary search is exact;
when it has some, the answer is verified by a linear scan (rare: it needs a parent evicted before
its child).

The precise index uses :class:`_ChainSet` instead, because it sees every block every engine stores
or evicts (tens of millions per simulated run; vLLM sends one ``BlockRemoved`` per evicted block): it keeps
no per-block bookkeeping (a plain set of hashes), so events apply as single C-level set updates, and exactness comes from
verifying the binary search's answer with one C-level membership pass over the hit (the search
ends on a present block followed by an absent one, so the first hole, if any, lies inside the
verified range).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from engines.hashing import present_run_end
from engines.kv_events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
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


class _Tier:
    """What an index asks of one instance's blocks in one medium; :class:`_BlockSet` (hash -> parent,
    with orphan bookkeeping) and :class:`_ChainSet` (a set of hashes) answer it. A base class, so the
    indexes hold ``list[_Tier]``."""

    __slots__ = ("blocks",)

    blocks: Any  # a dict (hash -> parent hash) or a set of hashes: its truth is "holds any block"

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, h: int, parent: int | None = None) -> bool:
        """Store ``h`` (child of ``parent``); False if it was already stored."""
        raise NotImplementedError

    def remove(self, h: int) -> bool:
        """Drop ``h``; False if it was not stored."""
        raise NotImplementedError

    def add_chain(self, hashes: Sequence[int], parent: int | None) -> None:
        """Store one ``BlockStored``'s hashes: each the child of the one before, the first of ``parent``."""
        for h in hashes:
            self.add(h, parent)
            parent = h

    def remove_many(self, hashes: Iterable[int]) -> None:
        """:meth:`remove` each hash (absent ones ignored)."""
        for h in hashes:
            self.remove(h)

    def clear(self) -> None:
        raise NotImplementedError

    def prefix_hit(self, hashes: Sequence[int], start: int = 0) -> int:
        """Length of the run of ``hashes[start:]`` present here, counted from ``start``."""
        raise NotImplementedError


class _BlockSet(_Tier):
    """Blocks of one instance in one medium: ``blocks`` maps hash -> parent hash (None = chain root).

    ``nchild[p]`` counts the stored children of ``p`` and ``orphans`` counts stored blocks whose
    parent is not stored; both are exact running totals, so "is this set prefix-closed?" is O(1).
    ``blocks`` is an OrderedDict (insertion order = recency) when ``lru`` is set, for the
    approximate index's LRU; a plain dict otherwise (half the memory).
    """

    __slots__ = ("nchild", "orphans")

    def __init__(self, lru: bool = False) -> None:
        self.blocks = OrderedDict() if lru else {}
        self.nchild: dict[int, int] = {}
        self.orphans = 0

    def add(self, h: int, parent: int | None = None) -> bool:
        blocks = self.blocks
        if h in blocks:
            return False
        blocks[h] = parent
        if parent is not None:
            nchild = self.nchild
            nchild[parent] = nchild.get(parent, 0) + 1
            if parent not in blocks:
                self.orphans += 1
        kids = self.nchild.get(h)
        if kids:  # its stored children were orphans until now
            self.orphans -= kids
        return True

    def remove(self, h: int) -> bool:
        blocks = self.blocks
        if h not in blocks:
            return False
        parent = blocks.pop(h)
        if parent is not None:
            if parent not in blocks:
                self.orphans -= 1
            left = self.nchild[parent] - 1
            if left:
                self.nchild[parent] = left
            else:
                del self.nchild[parent]
        kids = self.nchild.get(h)
        if kids:
            self.orphans += kids
        return True

    def clear(self) -> None:
        self.blocks.clear()
        self.nchild.clear()
        self.orphans = 0

    def prefix_hit(self, hashes: Sequence[int], start: int = 0) -> int:
        blocks = self.blocks
        n = len(hashes)
        if start >= n or hashes[start] not in blocks:
            return 0
        lo = present_run_end(hashes, blocks, start + 1, n)
        # By construction hashes[lo-1] was seen present and hashes[lo] (if any) absent: the boundary
        # is verified. Interior holes would leave an orphan; without orphans the answer is exact.
        if self.orphans:
            for j in range(start + 1, lo):
                if hashes[j] not in blocks:
                    return j - start
        return lo - start


class _ChainSet(_Tier):
    """Blocks of one instance in one medium for the precise index: ``blocks`` is a set of hashes.

    Same lookups and answers as :class:`_BlockSet`, without parents: a chained hash determines its
    parent, and nothing here reads it (exactness comes from verifying the search, see the module
    docstring), so events apply as single C-level set updates. Given the C speedups' ``BlockSet``
    (``gpuhit/_blockset.c``, passed in as ``new_set``), the set holds bare uint64 keys, probes
    batches with their slots prefetched and never rehashes while a full cache churns; it answers
    every operation used here as a Python set does (``tests/gateway/test_blockset.py``), 2x faster
    for an event's 128 hashes in and out of a million-hash set, in a third to a sixth of the memory.
    """

    __slots__ = ()

    def __init__(self, new_set: Callable[[], Any] | None = None) -> None:
        self.blocks = (new_set or set)()

    def reserve(self, n: int) -> None:
        """Room for ``n`` hashes now where the set can be sized (``BlockSet``; a Python set grows as
        it fills): an engine's cache filling up then never rehashes it mid-request."""
        reserve = getattr(self.blocks, "reserve", None)
        if reserve is not None:
            reserve(n)

    def add(self, h: int, parent: int | None = None) -> bool:
        """Store ``h``; False if it was already stored (``parent`` is accepted for symmetry)."""
        if h in self.blocks:
            return False
        self.blocks.add(h)
        return True

    def remove(self, h: int) -> bool:
        if h in self.blocks:
            self.blocks.remove(h)
            return True
        return False

    def add_chain(self, hashes: Sequence[int], parent: int | None) -> None:
        """Store every hash of one ``BlockStored`` (its ``parent`` is implied by the chain; an int64
        array from a chain-id engine is taken as its ints)."""
        self.blocks.update(hashes if type(hashes) is tuple else _ints(hashes))

    def remove_many(self, hashes: Iterable[int]) -> None:
        """:meth:`remove` each hash (absent ones ignored), in C."""
        self.blocks.difference_update(hashes)

    def clear(self) -> None:
        self.blocks.clear()

    def prefix_hit(self, hashes: Sequence[int], start: int = 0) -> int:
        blocks = self.blocks
        n = len(hashes)
        if start >= n or hashes[start] not in blocks:
            return 0
        lo = present_run_end(hashes, blocks, start + 1, n)
        # hashes[lo] (if any) is absent, so the first absent position is <= lo: verify below it
        if lo - start > 2:
            inner = hashes[start + 1 : lo - 1]  # hashes[lo - 1] was seen present
            if not blocks.issuperset(inner):  # one C loop of set probes: holes are rare
                return list(map(blocks.__contains__, inner)).index(False) + 1
        return lo - start



def _ints(hashes: Any) -> Any:
    """Python ints for a set of them: an int64 array's ``tolist``, any other sequence as it is."""
    tolist = getattr(hashes, "tolist", None)
    return tolist() if tolist is not None else hashes


def _hit(g_set: _Tier, c_set: _Tier, hashes: Sequence[int]) -> tuple[int, int]:
    """One instance's (GPU prefix hit, CPU-tier blocks continuing it)."""
    g = g_set.prefix_hit(hashes) if g_set.blocks else 0
    return (g, c_set.prefix_hit(hashes, g) if c_set.blocks else 0)


class _BaseIndex:
    __slots__ = ("_cpu", "_gpu", "num_instances")

    def __init__(self, num_instances: int, lru: bool = False):
        if num_instances <= 0:
            raise ConfigError(f"a KV index needs at least one instance, got {num_instances}")
        self.num_instances = num_instances
        self._gpu: list[_Tier] = [_BlockSet(lru) for _ in range(num_instances)]
        self._cpu: list[_Tier] = [_BlockSet() for _ in range(num_instances)]

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
        self._gpu = [_ChainSet(new_set) for _ in range(num_instances)]
        self._cpu = [_ChainSet(new_set) for _ in range(num_instances)]

    def reserve(self, gpu_blocks: Sequence[int | None]) -> None:
        """Size each instance's GPU tier for its engine's capacity in blocks (None: unknown, left to
        grow), so a cache filling up does not rehash the index mid-request (see :meth:`_ChainSet.reserve`)."""
        for tier, n in zip(self._gpu, gpu_blocks):
            if n and isinstance(tier, _ChainSet):
                tier.reserve(n)

    def on_kv_event(self, instance: int, batch: KVEventBatch) -> None:
        self._check(instance)
        gpu = self._gpu[instance]
        cpu = self._cpu[instance]
        # vLLM publishes one BlockRemoved per evicted block (the emulator one per allocation), so a
        # batch is mostly long runs of removals: a run on one medium is collected and applied in one call.
        run: list[int] = []
        extend = run.extend
        run_target: _Tier | None = None
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
                extend(hs if type(hs) is tuple else _ints(hs))
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

    def _tier(self, instance: int, medium: str | None) -> _Tier | None:
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
