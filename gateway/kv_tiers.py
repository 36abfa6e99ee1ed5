"""One instance's cached blocks in one medium, and the prefix hit of a chain of block hashes
over them: what each KV index (:mod:`gateway.kv_index`) keeps per instance and medium.

Why a search. Agentic prompts are ~6,500 blocks, so a linear prefix scan per instance per request is too
slow. vLLM block hashes are chained (a block's hash covers its whole prefix) and vLLM frees a
request's blocks tail first, so an instance's cached blocks of one chain are almost always
prefix-closed: cached up to some position, absent after. :meth:`ParentedTier.prefix_hit` therefore
binary-searches the chain positions (O(log n) dict probes). Exactness is kept by bookkeeping, not
hope: each set tracks its *orphans*, stored blocks whose parent is not stored. A hole inside the
searched range implies an orphan in it, so when a set has no orphans the binary search is exact;
when it has some, the answer is verified by a linear scan (rare: it needs a parent evicted before
its child).

The precise index uses :class:`ChainTier` instead, because it sees every block every engine stores
or evicts (tens of millions per simulated run; vLLM sends one ``BlockRemoved`` per evicted block): it keeps
no per-block bookkeeping (a plain set of hashes), so events apply as single C-level set updates, and exactness comes from
verifying the binary search's answer with one C-level membership pass over the hit (the search
ends on a present block followed by an absent one, so the first hole, if any, lies inside the
verified range).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from engines.hashing import present_run_end


class Tier:
    """What an index asks of one instance's blocks in one medium; :class:`ParentedTier` (hash -> parent,
    with orphan bookkeeping) and :class:`ChainTier` (a set of hashes) answer it. A base class, so the
    indexes hold ``list[Tier]``."""

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


class ParentedTier(Tier):
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


class ChainTier(Tier):
    """Blocks of one instance in one medium for the precise index: ``blocks`` is a set of hashes.

    Same lookups and answers as :class:`ParentedTier`, without parents: a chained hash determines its
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
        self.blocks.update(hashes if type(hashes) is tuple else as_ints(hashes))

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


def as_ints(hashes: Any) -> Any:
    """Python ints for a set of them: an int64 array's ``tolist``, any other sequence as it is."""
    tolist = getattr(hashes, "tolist", None)
    return tolist() if tolist is not None else hashes
