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
from engines.emulated.block_ids import positions
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


class ChainIdMap:
    """The fast path for chain ids: the block of id ``h`` is ``store[slot_of[h >> 12], h & 4095]``
    (-1: absent), a page of 4,096 ids per row of one 2-D array.

    A page gets a row when an id in its range is first cached and gives it back when its last one
    goes, so memory follows the cached blocks (a pool's cached chains span few pages), not the id
    range. Batches are whole-array operations whatever the pages they span (a 512-block chunk of
    a busy cluster spans several: its chains' ids were handed out at different times); single ids
    go through ``_pages``, a dict of the rows as views, which is the cheaper probe from Python.
    """

    __slots__ = ("_count", "_free", "_len", "_page_of", "_pages", "_slot_of", "_store")

    NO_KEY = -1

    @staticmethod
    def key_array(n: int) -> np.ndarray:
        return np.full(n, -1, np.int64)

    def __init__(self) -> None:
        self._store = np.full((8, _PAGE), -1, _BLOCK_ID)  # rows: pages in use (or free)
        self._count = np.zeros(8, np.int64)  # live entries per row
        self._page_of = np.full(8, -1, np.int64)  # the page a row holds (-1: free)
        self._free = list(range(7, -1, -1))  # free rows, popped from the end
        self._slot_of = np.full(64, -1, np.int64)  # page -> its row (-1: none)
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
        slot = self._row(p)
        page = self._pages[p]
        if page[h & _LOW] < 0:
            self._count[slot] += 1
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
        p, o = h >> _BITS, h & _LOW
        page = self._pages.get(p)
        b = -1 if page is None else int(page[o])
        if b < 0:
            raise KeyError(h)
        page[o] = -1  # type: ignore[index]
        slot = int(self._slot_of[p])
        left = self._count[slot] - 1
        self._count[slot] = left
        self._len -= 1
        if not left:
            self._release(slot)
        return b

    def __iter__(self) -> Iterator[int]:
        for p, page in list(self._pages.items()):
            yield from ((p << _BITS) + int(o) for o in np.flatnonzero(page >= 0))

    def clear(self) -> None:
        self.__init__()  # type: ignore[misc]

    # ---- batches -------------------------------------------------------------------------------
    def pop_all(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        slots = self._slot_of[keys >> _BITS]
        self._store.reshape(-1)[(slots << _BITS) | (keys & _LOW)] = -1
        self._drop_rows(slots, len(keys))

    def setdefault_all(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        n = len(keys)
        if not n:
            return None
        slots = self._rows(keys >> _BITS)
        at = (slots << _BITS) | (keys & _LOW)  # the entries in the flattened store
        flat = self._store.reshape(-1)
        cur = flat[at]
        new = cur < 0
        n_new = int(np.count_nonzero(new))
        got: np.ndarray | None = None
        if n_new == n:
            ids, s_new, at_new = blocks, slots, at
        else:
            got = np.array(blocks, _BLOCK_ID)
            got[~new] = cur[~new]
            ids, s_new, at_new = blocks[new], slots[new], at[new]
        if n_new:
            if n_new > 1:
                # a hash twice among the new ones shows as a position overwritten by a later one:
                # undo, and map them one by one so that the first one is cached, as the dict does
                pos = positions(n_new)
                flat[at_new] = pos
                if (flat[at_new] != pos).any():
                    flat[at_new] = -1
                    return self._setdefault_each(keys, blocks)
            flat[at_new] = ids
            self._add_to_rows(s_new, n_new)
        return got

    def get_all(self, hashes: Sequence[int]) -> np.ndarray | None:
        keys = self.keys(hashes)
        if not len(keys):
            return np.empty(0, _BLOCK_ID)
        pages = keys >> _BITS
        if int(pages.max()) >= len(self._slot_of):
            return None
        slots = self._slot_of[pages]
        if int(slots.min()) < 0:
            return None
        out = self._store.reshape(-1)[(slots << _BITS) | (keys & _LOW)]
        return None if int(out.min()) < 0 else out

    @staticmethod
    def keys(hashes: Sequence[int]) -> np.ndarray:
        """The hashes as the pool stores them: int64 (ConfigError for hashes that are not chain ids)."""
        return chain_id_array(hashes, "a chain-id block map needs them; build the engine with the map of its hashes")

    # ---- internals -----------------------------------------------------------------------------
    def _setdefault_each(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        got = [self.setdefault(h, b) for h, b in zip(keys.tolist(), blocks.tolist())]
        return None if got == blocks.tolist() else np.array(got, _BLOCK_ID)

    def _rows(self, pages: np.ndarray) -> np.ndarray:
        """The rows of these pages, given rows where they have none."""
        top = int(pages.max())
        if top >= len(self._slot_of):
            grown = np.full(max(2 * len(self._slot_of), top + 1), -1, np.int64)
            grown[: len(self._slot_of)] = self._slot_of
            self._slot_of = grown
        slots = self._slot_of[pages]
        if int(slots.min()) < 0:
            for p in np.unique(pages[slots < 0]).tolist():
                self._row(p)
            slots = self._slot_of[pages]
        return slots

    def _row(self, p: int) -> int:
        """The row of page ``p``, given one if it has none."""
        if p >= len(self._slot_of):
            self._rows(np.array([p]))
        slot = int(self._slot_of[p])
        if slot >= 0:
            return slot
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slot_of[p] = slot
        self._page_of[slot] = p
        self._pages[p] = self._store[slot]
        return slot

    def _grow(self) -> None:
        """Twice the rows (the store is copied: the row views in ``_pages`` are remade)."""
        n = len(self._count)
        store = np.full((2 * n, _PAGE), -1, _BLOCK_ID)
        store[:n] = self._store
        self._store = store
        self._count = np.concatenate([self._count, np.zeros(n, np.int64)])
        self._page_of = np.concatenate([self._page_of, np.full(n, -1, np.int64)])
        self._free.extend(range(2 * n - 1, n - 1, -1))
        self._pages = {p: store[int(self._slot_of[p])] for p in self._pages}

    def _add_to_rows(self, slots: np.ndarray, n: int) -> None:
        """``n`` entries joined these rows (one per element of ``slots``)."""
        if int(slots[0]) == int(slots[-1]) and not (slots != slots[0]).any():
            self._count[int(slots[0])] += n
        else:
            self._count += np.bincount(slots, minlength=len(self._count))
        self._len += n

    def _drop_rows(self, slots: np.ndarray, n: int) -> None:
        """``n`` entries left these rows (one per element of ``slots``): give emptied rows back."""
        count = self._count
        if int(slots[0]) == int(slots[-1]) and not (slots != slots[0]).any():
            s = int(slots[0])
            count[s] -= n
            emptied = [s] if not count[s] else []
        else:
            gone = np.bincount(slots, minlength=len(count))
            count -= gone
            emptied = np.flatnonzero((count == 0) & (gone > 0)).tolist()
        self._len -= n
        for s in emptied:
            self._release(s)

    def _release(self, slot: int) -> None:
        p = int(self._page_of[slot])
        self._page_of[slot] = -1
        self._slot_of[p] = -1
        del self._pages[p]
        self._free.append(slot)


__all__ = ["ChainIdMap", "HashMap"]
