"""Lower KV tiers below the GPU: a per-engine CPU offload tier and a (shareable) remote store.

A hit in a lower tier costs a transfer instead of a recompute: the request waits (vLLM's
WAITING_FOR_REMOTE_KVS) while other requests keep the GPU busy, then continues with the loaded
blocks cached on the GPU. Costs come from the engine's :class:`~engines.emulated.profile.Profile`.

* :class:`CPUTier` is fed by GPU evictions (a block leaving HBM is kept in host DRAM), LRU within
  its capacity, and publishes ``BlockStored``/``BlockRemoved`` with medium ``"CPU"``.
* :class:`RemoteStore` (Mooncake store) holds every block any attached engine computed, LRU within
  its capacity; one object can be shared by the engines of a simulation. It publishes no events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engines.kv_events import CPU, BlockRemoved, BlockStored, KVEvent


class LRUBlockSet:
    """Hashes in LRU order with a capacity in blocks; O(1) insert, touch and eviction."""

    __slots__ = ("_od", "capacity")

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity_blocks
        self._od: OrderedDict[int, int | None] = OrderedDict()

    def __contains__(self, h: int) -> bool:
        return h in self._od

    def __len__(self) -> int:
        return len(self._od)

    def prefix_run(self, hashes: Sequence[int], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]`` are present, consecutively from ``start``."""
        od = self._od
        n = 0
        for i in range(start, stop):
            if hashes[i] not in od:
                break
            n += 1
        return n

    def touch_run(self, hashes: Sequence[int], start: int, stop: int) -> None:
        move = self._od.move_to_end
        for i in range(start, stop):
            move(hashes[i])

    def put(self, h: int, parent: int | None) -> list[int] | None:
        """Insert (or refresh) ``h``; returns the hashes evicted to make room (None if new+no evict)."""
        od = self._od
        if h in od:
            od.move_to_end(h)
            return []
        if self.capacity == 0:
            return []
        evicted: list[int] = []
        while len(od) >= self.capacity:
            evicted.append(od.popitem(last=False)[0])
        od[h] = parent
        return evicted if evicted else None

    def hashes(self) -> set[int]:
        return set(self._od)


class CPUTier:
    """Host-DRAM offload tier of one engine (vLLM ``--kv-offloading-size``)."""

    def __init__(self, capacity_blocks: int, block_size: int, enable_events: bool = True):
        self.blocks = LRUBlockSet(capacity_blocks)
        self.block_size = block_size
        self.enable_events = enable_events
        self.events: list[KVEvent] = []

    def on_gpu_evict(self, h: int, parent: int | None) -> None:
        res = self.blocks.put(h, parent)
        if res == []:  # already there (refreshed) or zero capacity
            return
        if self.enable_events:
            if res:
                self.events.append(BlockRemoved(block_hashes=tuple(res), medium=CPU))
            self.events.append(
                BlockStored(
                    block_hashes=(h,), parent_block_hash=parent, token_ids=(),
                    block_size=self.block_size, medium=CPU,
                )
            )

    def take_events(self) -> list[KVEvent]:
        ev = self.events
        self.events = []
        return ev


class RemoteStore:
    """Remote KV store (Mooncake store over the NIC), shareable between engines."""

    def __init__(self, capacity_blocks: int):
        self.blocks = LRUBlockSet(capacity_blocks)
        self.bytes_loaded = 0
        self.blocks_loaded = 0

    def write_through(self, hashes: Sequence[int]) -> None:
        put = self.blocks.put
        for h in hashes:
            put(h, None)
