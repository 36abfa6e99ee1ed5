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
from engines.emulated.block_ids import distinct
from gpuhit.errors import ConfigError


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
    """The fast path for chain ids: ``page[id >> 12][id & 4095]`` holds the block (-1: absent).

    A page is allocated when an id in its range is first cached and dropped when its last one goes,
    so memory follows the cached blocks (a pool's cached chains span few pages), not the id range.
    """

    __slots__ = ("_count", "_len", "_pages", "_scratch")

    NO_KEY = -1

    @staticmethod
    def key_array(n: int) -> np.ndarray:
        return np.full(n, -1, np.int64)

    def __init__(self) -> None:
        self._pages: dict[int, np.ndarray] = {}
        self._count: dict[int, int] = {}  # live entries per page
        self._len = 0
        self._scratch = np.zeros(_PAGE, np.int64)

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
        page = self._page(h >> _BITS)
        if page[h & _LOW] < 0:
            self._count[h >> _BITS] += 1
            self._len += 1
        page[h & _LOW] = b

    def setdefault(self, h: int, b: int) -> int:
        got = self.get(h)
        if got is None:
            self[h] = b
            return b
        return got

    def __delitem__(self, h: int) -> None:
        if self.get(h) is None:
            raise KeyError(h)
        self._pages[h >> _BITS][h & _LOW] = -1
        self._drop(h >> _BITS, 1)

    def pop(self, h: int) -> int:
        p, o = h >> _BITS, h & _LOW
        page = self._pages.get(p)
        b = -1 if page is None else int(page[o])
        if b < 0:
            raise KeyError(h)
        page[o] = -1  # type: ignore[index]
        self._drop(p, 1)
        return b

    def __iter__(self) -> Iterator[int]:
        for p, page in list(self._pages.items()):
            yield from ((p << _BITS) + int(o) for o in np.flatnonzero(page >= 0))

    def clear(self) -> None:
        self._pages.clear()
        self._count.clear()
        self._len = 0

    # ---- batches -------------------------------------------------------------------------------
    def pop_all(self, keys: np.ndarray) -> None:
        for p, offs in self._by_page(keys):
            self._pages[p][offs] = -1
            self._drop(p, len(offs))

    def setdefault_all(self, keys: np.ndarray, blocks: np.ndarray) -> np.ndarray | None:
        got: np.ndarray | None = None
        pos = 0
        for p, offs in self._by_page(keys, ordered=True):
            n = len(offs)
            ids = blocks[pos : pos + n]
            if not distinct(offs, self._scratch):  # a hash twice in one batch: the first one is cached
                if got is None:
                    got = np.array(blocks, _BLOCK_ID)
                for i in range(pos, pos + n):
                    got[i] = self.setdefault(int(keys[i]), int(blocks[i]))
                pos += n
                continue
            page = self._page(p)
            cur = page[offs]
            new = cur < 0
            n_new = int(np.count_nonzero(new))
            if n_new == n:
                page[offs] = ids
            else:
                page[offs[new]] = ids[new]
                if got is None:
                    got = np.array(blocks, _BLOCK_ID)
                got[pos : pos + n][~new] = cur[~new]
            if n_new:
                self._count[p] += n_new
                self._len += n_new
            pos += n
        return got

    def get_all(self, hashes: Sequence[int]) -> np.ndarray | None:
        hs = self.keys(hashes)
        out = np.empty(len(hs), _BLOCK_ID)
        pos = 0
        for p, offs in self._by_page(hs, ordered=True):
            page = self._pages.get(p)
            if page is None:
                return None
            b = page[offs]
            if b.min() < 0:
                return None
            out[pos : pos + len(offs)] = b
            pos += len(offs)
        return out

    # ---- internals -----------------------------------------------------------------------------
    @staticmethod
    def keys(hashes: Sequence[int]) -> np.ndarray:
        """The hashes as the pool stores them: int64 (ConfigError for hashes that are not chain ids)."""
        try:
            hs = np.fromiter(hashes, np.int64, len(hashes))
        except OverflowError:
            hs = None
        if hs is None or (len(hs) and int(hs.min()) < 0):
            raise ConfigError("a chain-id block map was given hashes that are not chain ids (negative or beyond "
                              "int64): build the engine with the map of its hashes")
        return hs

    def _by_page(self, hs: np.ndarray, ordered: bool = False) -> Iterator[tuple[int, np.ndarray]]:
        """``(page, offsets)`` of the hashes, page by page; with ``ordered``, runs of one page in the
        order of ``hs`` (callers that pair them with a parallel array walk it in step)."""
        if not len(hs):
            return
        pages = hs >> _BITS
        first = int(pages[0])
        if int(pages[-1]) == first and not (pages != first).any():
            yield first, hs & _LOW
            return
        if ordered:
            bounds = [0, *(np.flatnonzero(pages[1:] != pages[:-1]) + 1).tolist(), len(hs)]
            for lo, hi in zip(bounds, bounds[1:]):
                yield int(pages[lo]), hs[lo:hi] & _LOW
            return
        for p in np.unique(pages):
            yield int(p), hs[pages == p] & _LOW

    def _page(self, p: int) -> np.ndarray:
        page = self._pages.get(p)
        if page is None:
            page = self._pages[p] = np.full(_PAGE, -1, np.int64)
            self._count[p] = 0
        return page

    def _drop(self, p: int, n: int) -> None:
        left = self._count[p] - n
        if left:
            self._count[p] = left
        else:
            del self._pages[p], self._count[p]
        self._len -= n


__all__ = ["ChainIdMap", "HashMap"]
