"""The block pool's map from a cached block hash to its block id: vLLM's hashes or chain ids.

Why two: every block a simulated engine computes evicts a cached block and caches a new one, so the
pool removes and inserts one hash per computed block (tens of millions in a replay of a large
trace). With vLLM's 64-bit hashes the map is a dict (:class:`HashMap`), one C-level operation per
block. In virtual time the hashes are the replayer's chain ids (:mod:`replayer.synth`): small
non-negative integers, consecutive along a chain; :class:`ChainIdMap` keeps them in numpy pages
indexed by the id itself, so a batch of a chain's blocks is added or removed by a few array writes.
The pool is given one of them where its engine is built; both answer every query alike (the same
blocks, the same first-cached block per hash), which ``tests/engines/emulated/test_hash_map.py``
holds them to.

Each map also decides how the pool stores a block's hash (``key_array``, ``NO_KEY``, ``keys``): a numpy
object array of the hash ints for :class:`HashMap` (vLLM's 64-bit hashes need not fit int64), a
plain int64 array for :class:`ChainIdMap`, so that a batch of evictions or cached blocks goes from
the pool's arrays to the map and back with no Python int per block.

Batch operations (the pool's hot paths) take the pool's key arrays: ``pop_all(keys)`` removes hashes
that are all present; ``setdefault_all(keys, blocks)`` maps each new hash to its block and returns
None when every hash was new, else, per hash, the block it maps to afterwards (its own, or the one
cached before: a duplicate); ``get_all(hashes)`` returns the blocks of hashes that are all present
as an id array, or None when one is absent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

from engines.emulated.block_ids import BLOCK_ID as _BLOCK_ID
from engines.keyed_hashes import chain_id_array


class HashMap(dict):
    """The reference map: a dict, for any int hashes (vLLM's event ints)."""

    NO_KEY = None

    @staticmethod
    def key_array(n: int) -> np.ndarray:
        return np.full(n, None, object)

    @staticmethod
    def keys(hashes: Sequence[int]) -> np.ndarray:
        """The hashes as the pool stores them: an object array of these very ints."""
        out = np.empty(len(hashes), object)
        out[:] = hashes
        return out

    def pop_all(self, keys: np.ndarray) -> None:
        deque(map(self.pop, keys.tolist()), 0)  # pop: a fast call, unlike the __delitem__ slot wrapper

    def setdefault_all(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        ids = blocks.tolist()
        got = list(map(self.setdefault, keys.tolist(), ids))
        return None if got == ids else np.array(got, _BLOCK_ID)

    def get_all(self, hashes: Sequence[int]) -> np.ndarray | None:
        try:
            return np.fromiter(map(self.get, hashes), _BLOCK_ID, len(hashes))
        except TypeError:  # a None: an absent hash
            return None


_BITS = 12
_PAGE = 1 << _BITS
_LOW = _PAGE - 1
#: the offset of a page that has no row: any id plus it is negative, so one ``min`` finds them
_ABSENT = -(1 << 62)


class ChainIdMap:
    """The fast path for chain ids: the block of id ``h`` is ``store.flat[h + base[h >> 12]]``
    (-1: absent), a page of 4,096 ids per row of one 2-D array, ``base[p]`` the offset that moves
    page ``p``'s ids onto its row (``_ABSENT`` while it has none).

    A page gets a row when an id in its range is first cached. Rows whose ids have all gone are
    given back when the rows run out (a sweep over the store, which also grows it when it frees
    less than a quarter), so memory follows the cached blocks (a pool's cached chains span few
    pages), not the id range, while the batch operations keep no per-row counts: a pool's
    eviction of a 512-block chunk is four numpy calls (page, offset, flat index, write) and its
    caching about ten, whatever the pages they span (a chunk of a busy cluster spans several: its
    chains' ids were handed out at different times). Single ids go through ``_pages``, a dict of
    the rows as views, which is the cheaper probe from Python.
    """

    __slots__ = ("_base", "_free", "_len", "_page_of", "_pages", "_store")

    NO_KEY = -1

    @staticmethod
    def key_array(n: int) -> np.ndarray:
        return np.full(n, -1, np.int64)

    def __init__(self) -> None:
        self._store = np.full((8, _PAGE), -1, _BLOCK_ID)  # rows: pages in use (or free)
        self._page_of = np.full(8, -1, np.int64)  # the page a row holds (-1: free)
        self._free = list(range(7, -1, -1))  # free rows, popped from the end
        self._base = np.full(64, _ABSENT, np.int64)  # page -> flat offset of its row minus its ids
        self._pages: dict[int, np.ndarray] = {}  # page -> its row (a view of _store)
        self._len = 0

    # ---- one hash ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __contains__(self, h: object) -> bool:
        page = self._pages.get(h >> _BITS)  # type: ignore[operator]
        return page is not None and page[h & _LOW] >= 0  # type: ignore[operator]

    def get(self, h: int, default: int | None = None) -> int | None:
        page = self._pages.get(h >> _BITS)
        if page is None:
            return default
        b = int(page[h & _LOW])
        return b if b >= 0 else default

    def __getitem__(self, h: int) -> int:
        b = self.get(h)
        if b is None:
            raise KeyError(h)
        return b

    def __setitem__(self, h: int, b: int) -> None:
        p = h >> _BITS
        self._row(p)
        page = self._pages[p]
        if page[h & _LOW] < 0:
            self._len += 1
        page[h & _LOW] = b

    def setdefault(self, h: int, b: int) -> int:
        got = self.get(h)
        if got is None:
            self[h] = b
            return b
        return got

    def __delitem__(self, h: int) -> None:
        self.pop(h)

    def pop(self, h: int) -> int:
        page = self._pages.get(h >> _BITS)
        b = -1 if page is None else int(page[h & _LOW])
        if b < 0:
            raise KeyError(h)
        page[h & _LOW] = -1  # type: ignore[index]
        self._len -= 1
        return b

    def __iter__(self) -> Iterator[int]:
        for p, page in list(self._pages.items()):
            yield from ((p << _BITS) + int(o) for o in np.flatnonzero(page >= 0))

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    def pages(self) -> set[int]:
        """The pages that hold a row now, empty ones included until the next sweep (tests)."""
        return set(self._pages)

    # ---- batches -------------------------------------------------------------------------------
    def pop_all(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        self._store.reshape(-1)[keys + self._base[keys >> _BITS]] = -1
        self._len -= len(keys)

    def setdefault_all(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        n = len(keys)
        if not n:
            return None
        at = self._at(keys)
        flat = self._store.reshape(-1)
        cur = flat[at]
        if int(cur.max()) < 0:  # every hash new (the common case)
            return None if self._write_distinct(flat, at, blocks) else self._setdefault_each(keys, blocks)
        new = cur < 0
        got = np.array(blocks, _BLOCK_ID)
        got[~new] = cur[~new]
        if new.any() and not self._write_distinct(flat, at[new], blocks[new]):
            return self._setdefault_each(keys, blocks)
        return got

    def _write_distinct(self, flat: np.ndarray, at: np.ndarray, ids: np.ndarray) -> bool:
        """Map new hashes (at ``at``) to ``ids``; False, with nothing written, when a hash comes twice in
        the batch: it shows as a block overwritten by a later one (the blocks are distinct), and the
        caller maps them one by one so that the first one is cached, as the dict does."""
        flat[at] = ids
        if len(ids) > 1 and (flat[at] != ids).any():
            flat[at] = -1
            return False
        self._len += len(ids)
        return True

    def get_all(self, hashes: Sequence[int]) -> np.ndarray | None:
        keys = self.keys(hashes)
        if not len(keys):
            return np.empty(0, _BLOCK_ID)
        pages = keys >> _BITS
        if int(pages.max()) >= len(self._base):
            return None
        at = keys + self._base[pages]
        if int(at.min()) < 0:
            return None
        out = self._store.reshape(-1)[at]
        return None if int(out.min()) < 0 else out

    @staticmethod
    def keys(hashes: Sequence[int]) -> np.ndarray:
        """The hashes as the pool stores them: int64 (ConfigError for hashes that are not chain ids)."""
        return chain_id_array(hashes, "a chain-id block map needs them; build the engine with the map of its hashes")

    # ---- internals -----------------------------------------------------------------------------
    def _setdefault_each(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        got = [self.setdefault(h, b) for h, b in zip(keys.tolist(), blocks.tolist())]
        return None if got == blocks.tolist() else np.array(got, _BLOCK_ID)

    def _at(self, keys: np.ndarray) -> np.ndarray:
        """The entries of these ids in the flattened store, given their pages rows where they have none."""
        pages = keys >> _BITS
        if int(pages.max()) >= len(self._base):
            self._grow_base(int(pages.max()))
        at = keys + self._base[pages]
        if int(at.min()) < 0:
            new = np.unique(pages[at < 0]).tolist()
            # rows first; a sweep for them keeps the rows of this batch's pages, empty or not
            self._reserve(len(new), pages)
            for p in new:
                self._row(p)
            at = keys + self._base[pages]
        return at

    def _grow_base(self, top: int) -> None:
        grown = np.full(max(2 * len(self._base), top + 1), _ABSENT, np.int64)
        grown[: len(self._base)] = self._base
        self._base = grown

    def _row(self, p: int) -> int:
        """The row of page ``p``, given one if it has none."""
        if p >= len(self._base):
            self._grow_base(p)
        if p in self._pages:
            return int(self._base[p] + (p << _BITS)) >> _BITS
        self._reserve(1)
        slot = self._free.pop()
        self._page_of[slot] = p
        self._base[p] = (slot - p) << _BITS
        self._pages[p] = self._store[slot]
        return slot

    def _reserve(self, k: int, keep: np.ndarray | None = None) -> None:
        """At least ``k`` free rows: a sweep when short (keeping the rows of pages ``keep``), then
        growth while still short."""
        if len(self._free) < k:
            self._sweep(keep)
            while len(self._free) < k:
                self._grow()

    def _sweep(self, keep: np.ndarray | None = None) -> None:
        """Give back the rows whose ids have all gone, except those of pages ``keep``; grow the
        store when that frees less than a quarter of it (so sweeps stay rare: amortized O(1) per
        row handed out)."""
        live = (self._store >= 0).any(axis=1)
        if keep is not None:
            offsets = self._base[keep]
            held = offsets != _ABSENT
            live[(offsets[held] >> _BITS) + keep[held]] = True
        empty = np.flatnonzero(~live & (self._page_of >= 0))
        for slot in empty.tolist():
            p = int(self._page_of[slot])
            self._page_of[slot] = -1
            self._base[p] = _ABSENT
            del self._pages[p]
            self._free.append(slot)
        if 4 * len(self._free) < len(self._page_of):
            self._grow()

    def _grow(self) -> None:
        """Twice the rows (the store is copied: the row views in ``_pages`` are remade; the flat
        offsets in ``_base`` stay valid, rows keeping their numbers)."""
        n = len(self._page_of)
        store = np.full((2 * n, _PAGE), -1, _BLOCK_ID)
        store[:n] = self._store
        self._store = store
        self._page_of = np.concatenate([self._page_of, np.full(n, -1, np.int64)])
        self._free.extend(range(2 * n - 1, n - 1, -1))
        self._pages = {p: store[int(self._base[p] >> _BITS) + p] for p in self._pages}


__all__ = ["ChainIdMap", "HashMap"]
