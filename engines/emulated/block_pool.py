"""The GPU KV block pool, modelled on vLLM v1's ``BlockPool`` and ``FreeKVCacheBlockQueue``.

Mechanism only: which physical block holds what, in which order blocks are reused, and the KV
events that follow. vLLM's semantics, kept exactly because routers read them through KV events:

* Block 0 is the *null block*: popped from the free queue at start-up and never handed out, so
  ``num_blocks - 1`` blocks are usable (vLLM reserves it as a placeholder in block tables).
* The free queue is ordered: allocation pops from the head; freed blocks holding a hash are
  appended at the tail in the order the caller gives (a finished request frees its blocks in
  *reverse*, so the tail of a prompt is evicted before its head); freed blocks holding no hash
  are put at the *head*, in that order (vLLM 0.32 reuses them first: they can never be a hit). A cached block whose ref count drops to 0 stays in the free
  queue with its hash: it is an eviction candidate and still a prefix hit; a hit "touches" it out
  of the queue.
* Reusing a cached block for a new allocation evicts it: its hash leaves the hash map and is
  reported in a ``BlockRemoved``. vLLM does not de-duplicate: two requests computing the same block
  at once both cache it; lookups return the first one cached.

Representation (speed, no behaviour): a block is its integer id, and the per-block state lives in
arrays indexed by id (reference counts in numpy; hashes in the array the hash map chooses: objects
for vLLM's 64-bit hashes, int64 for the replayer's chain ids, :mod:`engines.emulated.hash_map`). An agentic prompt hits thousands of cached blocks, and
each request touches them all when admitted and frees them all when it finishes; as numpy
operations over id arrays that is ~15 ns a block, where a Python loop over block objects took
~150 ns and was a sixth of a simulation's time. The free queue is vLLM's doubly linked list made
lazy (:class:`engines.emulated.block_ids.FreeBlockQueue`) for the same reason.

Events: vLLM queues one ``BlockRemoved`` per evicted block. Here the evictions of one allocation
(consecutive in the event stream anyway) share one ``BlockRemoved`` listing their hashes in
eviction order: the same information in vLLM's format (``block_hashes`` is a list), and the same
index state for any consumer, but one event object instead of thousands. Building those per-block
event objects was a fifth of a saturated simulation's time. With chain ids (virtual time) the
events' ``block_hashes`` are the pool's int64 arrays, not tuples, and a batch of evictions is one
``BlockRemoved`` even where vLLM would publish one per allocation: the simulator's index takes
them as arrays (:mod:`gateway.kv_index_chain`), with no Python int per block.

Watch (speed, no behaviour): the KV manager may *watch* one set of cached blocks (a waiting
request's prefix hit that could not be allocated, which vLLM looks up again every step). The pool
raises ``watch_dirty`` whenever something happens that could change that lookup's answer or its
count of evictable blocks: a watched block evicted, or its reference count crossing zero (touch /
free). A new block cached right after the hit is checked by the manager itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from engines.emulated.block_ids import BLOCK_ID, NO_BLOCKS, FreeBlockQueue, as_block_ids, distinct
from engines.emulated.hash_map import ChainIdMap, HashMap
from engines.keyed_hashes import keys_of
from engines.kv_events import GPU, BlockRemoved, BlockStored, KVEvent


class BlockPool:
    """Fixed pool of ``num_blocks`` blocks of ``block_size`` tokens with a prefix-cache hash map.

    Blocks are ids ``0..num_blocks-1``. Per block: ``ref_cnt[id]`` (users), ``block_hash[id]``
    (its hash while cached, else the map's ``NO_KEY``; ``has_hash[id]`` says which) and ``parent_hash[id]`` (kept only when a CPU
    tier reads it). ``on_evict(block_hash, parent_hash)`` is called when a cached block is evicted
    for reuse, so a CPU offload tier can take it (vLLM's offloading connector is fed the same way
    in this model). ``hash_map``: the map class of the hashes (:mod:`engines.emulated.hash_map`:
    ``HashMap`` for any hashes, ``ChainIdMap`` for the replayer's chain ids).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_events: bool = True,
        on_evict: Callable[[int, int | None], None] | None = None,
        hash_map: Callable[[], HashMap | ChainIdMap] = HashMap,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = np.zeros(num_blocks, np.int32)
        self._cached = hash_map()  # hash -> block id (a dict, or numpy pages for chain ids)
        # the hashes as the map keeps them (objects for vLLM's hashes, int64 for chain ids)
        self.block_hash = self._cached.key_array(num_blocks)
        self._no_key = self._cached.NO_KEY
        # chain ids: int64 keys, which the requests also carry as arrays (KeyedHashes), so runs of
        # blocks compare with a prompt's ids as arrays (kv_manager's run check) and events carry them
        self.int_keys = self.block_hash.dtype != object
        # block_hash[id] is not None, kept beside it so that masks over many blocks are one numpy
        # operation instead of a Python comparison per object
        self.has_hash = np.zeros(num_blocks, bool)
        # the parent's hash, kept so an eviction to a lower tier can publish the chain link
        self.parent_hash = np.full(num_blocks, None, object)
        self.free_queue = FreeBlockQueue(num_blocks, np.arange(num_blocks, dtype=BLOCK_ID))
        self.null_block = int(self.free_queue.popleft_many(1)[0])  # block 0, as vLLM does
        # further blocks holding an already-cached hash, in caching order (vLLM keeps them all)
        self._dups: dict[int, list[int]] = {}
        self.enable_events = enable_events
        self.events: list[KVEvent] = []
        self.on_evict = on_evict
        # see "Watch" in the module docstring; watching False = nothing watched (hot paths skip it)
        self.watching = False
        self._watch = np.zeros(num_blocks, bool)
        self._watched = NO_BLOCKS
        self.watch_dirty = False
        self._mark = np.zeros(num_blocks, np.int64)  # scratch for distinct()

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

    def get_cached_block(self, block_hash: int) -> int | None:
        return self._cached.get(block_hash)

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def reset_cache(self) -> None:
        """Forget every cached hash (vLLM's prefix-cache reset); the caller checked nothing is in use."""
        self.block_hash[:] = self._no_key
        self.has_hash[:] = False
        self.parent_hash[:] = None
        self._cached.clear()
        self._dups.clear()
        self.watch_dirty = True

    def take_events(self) -> list[KVEvent]:
        ev = self.events
        self.events = []
        return ev

    # ---- watch ---------------------------------------------------------------------------------
    def set_watch(self, blocks: np.ndarray) -> None:
        """Watch ``blocks`` (none: stop watching) and clear ``watch_dirty``."""
        self._watch[self._watched] = False
        self._watched = blocks
        self._watch[blocks] = True
        self.watching = len(blocks) > 0
        self.watch_dirty = False

    def _watched_any(self, ids: np.ndarray) -> bool:
        return bool(self._watch[ids].any())

    # ---- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, n: int, event_per_block: bool = False) -> np.ndarray:
        """Pop ``n`` blocks from the head of the free queue, evicting cached ones; ref count 1.

        Evictions, their events and ``on_evict`` calls follow the popping order. The evictions share
        one ``BlockRemoved``; with ``event_per_block`` each gets its own, as ``n`` allocations of
        one block would publish them (a decode stretch's allocations made in one pop).
        """
        q = self.free_queue
        if n > q.num_free:
            raise ValueError(f"cannot get {n} free blocks from the pool")
        if n <= 0:
            return NO_BLOCKS
        ids = q.popleft_many(n)
        self.ref_cnt[ids] = 1
        if n == 1:
            b = int(ids[0])
            if not self.has_hash[b]:
                return ids
            if not self._dups and self.on_evict is None:
                # one eviction (every decode that starts a block): scalar operations only
                if self.watching and not self.watch_dirty and self._watch[b]:
                    self.watch_dirty = True
                h = self.block_hash.item(b)
                self._cached.pop(h)
                self.block_hash[b] = self._no_key
                self.has_hash[b] = False
                if self.enable_events:
                    self.events.append(BlockRemoved((h,), GPU))
                return ids
            evicted = ids
        else:
            cached = self.has_hash[ids]
            n_cached = int(np.count_nonzero(cached))  # in a full cache nearly every popped block is cached
            if not n_cached:
                return ids
            evicted = ids if n_cached == n else ids[cached]
        keys = self.block_hash[evicted]
        if self.watching and not self.watch_dirty and self._watched_any(ids):
            self.watch_dirty = True
        if self._dups or self.on_evict is not None:
            for b in evicted.tolist():
                self._evict(b)
        else:
            # no duplicates anywhere: each hash maps to the block being evicted
            self._cached.pop_all(keys)
            self.block_hash[evicted] = self._no_key  # parent_hash is left stale: read only while cached
            self.has_hash[evicted] = False
        if self.enable_events:
            if self.int_keys:  # chain ids: the int64 array itself (see "Events" above)
                self.events.append(BlockRemoved(keys, GPU))
                return ids
            hs = tuple(keys.tolist())
            if event_per_block:
                self.events.extend([BlockRemoved((h,), GPU) for h in hs])
            else:
                self.events.append(BlockRemoved(hs, GPU))
        return ids

    def _evict(self, b: int) -> None:
        """General eviction (duplicates, an ``on_evict`` tier); the caller handled the watch and
        reports the hash in its ``BlockRemoved``."""
        assert self.has_hash[b]
        h = self.block_hash.item(b)
        if self._cached.get(h) == b:
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
            self.on_evict(h, self.parent_hash[b])
        self.block_hash[b] = self._no_key
        self.has_hash[b] = False
        self.parent_hash[b] = None

    def touch(self, blocks: Iterable[int]) -> bool:
        """A prefix hit: take ref-0 blocks out of the free queue and count the new user; returns
        whether no block was listed twice.

        A block listed twice (hashes that are not chained can map two positions to one block)
        gains one reference per occurrence, as in vLLM's loop.
        """
        ids = as_block_ids(blocks)
        if not len(ids):
            return True
        counts: np.ndarray | int = 1
        unique = distinct(ids, self._mark)
        if not unique:
            ids, counts = np.unique(ids, return_counts=True)
        ref = self.ref_cnt
        r = ref[ids]
        leaving = ids[r == 0]
        if len(leaving):
            # a watched block leaving ref count 0 changes the watcher's evictable count
            if self.watching and not self.watch_dirty and self._watched_any(leaving):
                self.watch_dirty = True
            self.free_queue.remove_many(leaving)
        ref[ids] = r + counts
        return unique

    def free_blocks(self, ordered: Iterable[int], known_distinct: bool = False) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue tail in this order.

        A block listed twice loses one reference per occurrence and, reaching 0, joins where its
        last occurrence is (vLLM's loop appends it when the last reference goes). ``known_distinct``:
        the caller knows no block is listed twice (the KV manager tracks it per request), which
        skips checking the request's thousands of blocks again.
        """
        ids = as_block_ids(ordered)
        if not len(ids):
            return
        counts: np.ndarray | int = 1
        if not (known_distinct or distinct(ids, self._mark)):
            uniq, first_rev, counts = np.unique(ids[::-1], return_index=True, return_counts=True)
            by_last = np.argsort(-first_rev)  # the last occurrence is the first one reversed
            ids, counts = uniq[by_last], counts[by_last]
        ref = self.ref_cnt
        r = ref[ids] - counts
        ref[ids] = r
        joining = ids[r == 0]
        if len(joining):
            # vLLM 0.32: blocks holding no hash can never be a hit, so they are reused first
            # (put at the head, for GPU locality); cached ones join the tail in LRU order
            uncached = ~self.has_hash[joining]
            if uncached.any():
                if uncached.all():
                    self.free_queue.prepend_many(joining)
                else:
                    self.free_queue.prepend_many(joining[uncached])
                    self.free_queue.append_many(joining[~uncached])
            else:
                self.free_queue.append_many(joining)
            # a watched block reaching ref count 0 (it only can by this call) joins the evictables
            if self.watching and not self.watch_dirty and self._watched_any(joining):
                self.watch_dirty = True

    def cache_full_blocks(
        self,
        blocks: Sequence[int] | np.ndarray,
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
        seg = as_block_ids(blocks)[start:end]
        arr = keys_of(hashes) if self.int_keys else None
        # chain ids: the request's int64 array; the ids as Python ints only for the rare duplicate
        hs = tuple(hashes[start:end]) if arr is None else None
        keys = arr[start:end] if arr is not None else self._cached.keys(hs)
        # One batch maps each new hash to its block; a hash already cached keeps its block, and the
        # map hands that back, so a duplicate (a recomputed last block, a hash twice in the run)
        # shows up as a mismatch with ``seg``.
        got = self._cached.setdefault_all(keys, seg)
        if got is not None:
            dups = self._dups
            for b, h, c in zip(seg.tolist(), hs if hs is not None else keys.tolist(), got.tolist()):
                if c != b:  # vLLM keeps the duplicate blocks, first cached one in the map
                    dups.setdefault(h, []).append(b)
        self.block_hash[seg] = keys
        self.has_hash[seg] = True
        if self.on_evict is not None:
            # parent_hash is read only by on_evict (the CPU tier's BlockStored)
            self.parent_hash[seg] = HashMap.keys((parent, *hashes[start : end - 1]))
        if self.enable_events:
            self.events.append(
                BlockStored(
                    block_hashes=keys if self.int_keys else hs,
                    parent_block_hash=parent,
                    token_ids=token_ids,
                    block_size=self.block_size,
                    medium=GPU,
                )
            )
