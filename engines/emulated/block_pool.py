"""The GPU KV block pool, modelled on vLLM v1's ``BlockPool`` and ``FreeKVCacheBlockQueue``.

Mechanism only: which physical block holds what, in which order blocks are reused, and the KV
events that follow. vLLM's semantics, kept exactly because routers read them through KV events:

* Block 0 is the *null block*: popped from the free queue at start-up and never handed out, so
  ``num_blocks - 1`` blocks are usable (vLLM reserves it as a placeholder in block tables).
* The free queue is a doubly linked list: allocation pops from the head; freed blocks are appended
  at the tail in the order the caller gives (a finished request frees its blocks in *reverse*, so
  the tail of a prompt is evicted before its head). A cached block whose ref count drops to 0
  stays in the free queue with its hash: it is an eviction candidate and still a prefix hit;
  a hit "touches" it out of the queue in O(1).
* Reusing a cached block for a new allocation evicts it: its hash leaves the hash map and is
  reported in a ``BlockRemoved``. vLLM does not de-duplicate: two requests computing the same block
  at once both cache it; lookups return the first one cached.

Events: vLLM queues one ``BlockRemoved`` per evicted block. Here the evictions of one allocation
(consecutive in the event stream anyway) share one ``BlockRemoved`` listing their hashes in
eviction order: the same information in vLLM's format (``block_hashes`` is a list), and the same
index state for any consumer, but one event object instead of thousands. Building those per-block
event objects was a fifth of a saturated simulation's time.

Watch (speed, no behaviour): the KV manager may *watch* one set of cached blocks (a waiting
request's prefix hit that could not be allocated, which vLLM looks up again every step). The pool
raises ``watch_dirty`` whenever something happens that could change that lookup's answer or its
count of evictable blocks: a watched block evicted, or its reference count crossing zero (touch /
free). A new block cached right after the hit is checked by the manager itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engines.kv_events import GPU, BlockRemoved, BlockStored, KVEvent


class KVBlock:
    """One physical KV block. ``block_hash`` is the 64-bit event int while cached, else None."""

    __slots__ = ("block_hash", "block_id", "next", "parent_hash", "prev", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # the parent's hash, kept so an eviction to a lower tier can publish the chain link
        self.parent_hash: int | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue``: O(1) popleft, append and removal from the middle."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Sequence[KVBlock]):
        self._head = KVBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVBlock(-2)
        prev = self._head
        for b in blocks:
            prev.next = b
            b.prev = prev
            prev = b
        prev.next = self._tail
        self._tail.prev = prev
        self.num_free = len(blocks)

    def popleft(self) -> KVBlock:
        b = self._head.next
        if b is self._tail:
            raise IndexError("no free blocks")
        nxt = b.next
        self._head.next = nxt
        nxt.prev = self._head
        b.prev = b.next = None
        self.num_free -= 1
        return b

    def remove(self, b: KVBlock) -> None:
        p, n = b.prev, b.next
        assert p is not None and n is not None, "block is not in the free queue"
        p.next = n
        n.prev = p
        b.prev = b.next = None
        self.num_free -= 1

    def append(self, b: KVBlock) -> None:
        last = self._tail.prev
        last.next = b
        b.prev = last
        b.next = self._tail
        self._tail.prev = b
        self.num_free += 1

    def block_ids(self) -> list[int]:
        """Head-to-tail ids (tests and debugging; O(n))."""
        out = []
        b = self._head.next
        while b is not self._tail:
            out.append(b.block_id)
            b = b.next
        return out


class BlockPool:
    """Fixed pool of ``num_blocks`` blocks of ``block_size`` tokens with a prefix-cache hash map.

    ``on_evict(block_hash, parent_hash)`` is called when a cached block is evicted for reuse, so a
    CPU offload tier can take it (vLLM's offloading connector is fed the same way in this model).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_events: bool = True,
        on_evict: Callable[[int, int | None], None] | None = None,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()  # block 0, as vLLM does
        self._cached: dict[int, KVBlock] = {}
        # further blocks holding an already-cached hash, in caching order (vLLM keeps them all)
        self._dups: dict[int, list[KVBlock]] = {}
        self.enable_events = enable_events
        self.events: list[KVEvent] = []
        self.on_evict = on_evict
        # see "Watch" in the module docstring; None = nothing watched (the hot paths skip the checks)
        self.watch: set[KVBlock] | None = None
        self.watch_dirty = False

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def num_free(self) -> int:
        """Free blocks, including evictable cached ones (ref count 0)."""
        return self.free_queue.num_free

    def usage(self) -> float:
        """vLLM's ``get_usage``: fraction of usable blocks in use (ref count > 0)."""
        return 1.0 - self.free_queue.num_free / self.num_usable

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def reset_cache(self) -> None:
        """Forget every cached hash (vLLM's prefix-cache reset); the caller checked nothing is in use."""
        for b in self.blocks:
            b.block_hash = None
            b.parent_hash = None
        self._cached.clear()
        self._dups.clear()
        self.watch_dirty = True

    def take_events(self) -> list[KVEvent]:
        ev = self.events
        self.events = []
        return ev

    # ---- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the head of the free queue, evicting cached ones; ref count 1.

        Hot path (every computed block passes here, and in a full cache nearly every one evicts):
        the ``n`` blocks are unlinked in one walk and the common eviction (no duplicate of the
        hash) is inlined; order of evictions, events and ``on_evict`` calls is the popping order.
        """
        q = self.free_queue
        if n > q.num_free:
            raise ValueError(f"cannot get {n} free blocks from the pool")
        out: list[KVBlock] = []
        if n <= 0:
            return out
        append = out.append
        cached = self._cached
        dups = self._dups
        events = self.events if self.enable_events else None
        on_evict = self.on_evict
        watch = self.watch
        removed: list[int] = []  # evicted hashes, in eviction order (one BlockRemoved)
        evicted = removed.append
        general = bool(dups) or on_evict is not None
        head = q._head
        b = head.next
        for _ in range(n):
            h = b.block_hash
            if h is not None:
                if watch and b in watch:
                    self.watch_dirty = True
                if general:
                    self._evict(b)
                else:
                    # no duplicates anywhere: b is the block the hash maps to. parent_hash is
                    # left stale: it is only read while block_hash is set, and caching rewrites it.
                    del cached[h]
                    b.block_hash = None
                evicted(h)
            b.ref_cnt = 1
            append(b)
            # prev/next are left stale: only free-queue members (ref count 0) have theirs read
            b = b.next
        head.next = b
        b.prev = head
        q.num_free -= n
        if removed and events is not None:
            events.append(BlockRemoved(tuple(removed), GPU))
        return out

    def _evict(self, b: KVBlock) -> None:
        """General eviction (duplicates, an ``on_evict`` tier); the caller handled the watch and
        reports the hash in its ``BlockRemoved``."""
        h = b.block_hash
        assert h is not None
        if self._cached.get(h) is b:
            dups = self._dups.get(h)
            if dups:
                self._cached[h] = dups.pop(0)
                if not dups:
                    del self._dups[h]
            else:
                del self._cached[h]
        else:
            dups = self._dups[h]
            dups.remove(b)
            if not dups:
                del self._dups[h]
        if self.on_evict is not None:
            self.on_evict(h, b.parent_hash)
        b.block_hash = None
        b.parent_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A prefix hit: take ref-0 cached blocks out of the free queue and count the new user."""
        # FreeBlockQueue.remove inlined: this loop runs once per hit block (thousands per long prompt)
        q = self.free_queue
        watch = self.watch
        if watch and not self.watch_dirty:
            if not isinstance(blocks, (list, tuple)):
                blocks = list(blocks)
            # a watched block leaving ref count 0 changes the watcher's evictable count
            for b in watch.intersection(blocks):
                if b.ref_cnt == 0:
                    self.watch_dirty = True
                    break
        removed = 0
        for b in blocks:
            if b.ref_cnt == 0:
                p, n = b.prev, b.next
                p.next = n
                n.prev = p
                b.prev = b.next = None
                removed += 1
            b.ref_cnt += 1
        q.num_free -= removed

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue tail in this order."""
        q = self.free_queue
        watch = self.watch
        if watch and not self.watch_dirty and not isinstance(ordered, (list, tuple)):
            ordered = list(ordered)
        tail = q._tail
        last = tail.prev
        added = 0
        for b in ordered:  # FreeBlockQueue.append inlined (hot path)
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                last.next = b
                b.prev = last
                last = b
                added += 1
        last.next = tail
        tail.prev = last
        q.num_free += added
        if watch and not self.watch_dirty:
            # a watched block reaching ref count 0 (it only can by this call) joins the evictables
            for b in watch.intersection(ordered):
                if b.ref_cnt == 0:
                    self.watch_dirty = True
                    break

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[int],
        start: int,
        end: int,
        token_ids: tuple[int, ...] = (),
    ) -> None:
        """Register blocks ``start..end-1`` under ``hashes[start:end]`` and queue one BlockStored.

        ``token_ids`` are the tokens of those blocks (empty when the engine does not publish them).
        """
        if start >= end:
            return
        parent = hashes[start - 1] if start > 0 else None
        cached = self._cached
        seg = blocks[start:end]
        hs = tuple(hashes[start:end])
        # Hot path (every computed block passes here): one C-level pass maps each new hash to its
        # block; ``setdefault`` hands back the block already cached under a hash, so a duplicate
        # (a recomputed last block, a hash twice in the run) shows up as a mismatch with ``seg``.
        got = list(map(cached.setdefault, hs, seg))
        if got != seg:  # identity comparison: KVBlock has no __eq__
            dups = self._dups
            for b, h, c in zip(seg, hs, got):
                if c is not b:  # vLLM keeps the duplicate blocks, first cached one in the map
                    dups.setdefault(h, []).append(b)
        if self.on_evict is None:
            # parent_hash is read only by on_evict (the CPU tier's BlockStored), so it is left stale
            for b, h in zip(seg, hs):
                b.block_hash = h
        else:
            p = parent
            for b, h in zip(seg, hs):
                b.block_hash = h
                b.parent_hash = p
                p = h
        if self.enable_events:
            self.events.append(
                BlockStored(
                    block_hashes=hs,
                    parent_block_hash=parent,
                    token_ids=token_ids,
                    block_size=self.block_size,
                    medium=GPU,
                )
            )
