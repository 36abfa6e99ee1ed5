"""Where the synthesizer's chain ids come from (the ``identity="chain"`` of :mod:`replayer.synth`).

A chain id names one engine block together with its whole chain of predecessors, as vLLM's chained
hash does, but as a small integer handed out in order: fresh for each new trie node's blocks
(consecutive along a chain, which keeps the engines' and the index's tables compact), one per
``(model, block index)`` for blocks wholly inside a model's system prompt (the same tokens in every
conversation of that model), and one set per turn for blocks that reach into the turn's own tail.
"""

from __future__ import annotations

import numpy as np

from gpuhit.errors import ConfigError


class ChainIds:
    """The id source of one synthesizer (engine block size ``block_size``)."""

    __slots__ = ("_block_size_of", "_next", "_system", "_tails", "block_size", "issued")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.issued = 0  # ids handed out for blocks (system ones counted each time they are used)
        self._next = 1
        self._system: dict[tuple[str, int], int] = {}
        self._tails: dict[tuple[str, str, int], np.ndarray] = {}
        self._block_size_of: dict[str, int] = {}  # namespace -> its trace block size

    def check_namespace(self, namespace: str, trace_block_size: int) -> None:
        """One trace block size per namespace: the trie's identity of a block rests on it (two sizes
        in one namespace could give equal tokens two different chains)."""
        known = self._block_size_of.setdefault(namespace, trace_block_size)
        if known != trace_block_size:
            raise ConfigError(f"namespace {namespace!r} has sessions of trace block sizes {known} and "
                              f"{trace_block_size}: the chain identity needs one block size per namespace "
                              "(use identity='vllm')")

    def fresh(self, lo: int, hi: int, model: str, system_len: int) -> list[int]:
        """Ids for engine blocks ``lo..hi-1`` of one new chain piece: a block wholly inside the system
        prompt (``system_len`` tokens of ``model``) takes that model's shared id, the rest new ones."""
        out: list[int] = []
        sys_hi = min(hi, system_len // self.block_size)
        if lo < sys_hi:
            ids = self._system
            for j in range(lo, sys_hi):
                i = ids.get((model, j))
                if i is None:
                    i = ids[(model, j)] = self._next
                    self._next += 1
                out.append(i)
        first = max(lo, sys_hi)
        if first < hi:
            n = self._next
            out.extend(range(n, n + hi - first))
            self._next = n + hi - first
        self.issued += hi - lo
        return out

    def tail(self, turn: tuple[str, str, int], lo: int, hi: int, model: str, system_len: int) -> np.ndarray:
        """Ids of blocks ``lo..hi-1`` that reach into ``turn``'s own tail (namespace, session, turn
        index), as int64: the same ids each time that turn is asked for."""
        ids = self._tails.get(turn)
        if ids is None:
            ids = self._tails[turn] = np.array(self.fresh(lo, hi, model, system_len), np.int64)
        return ids

    def clear(self) -> None:
        self._next = 1
        self._system.clear()
        self._tails.clear()
        self._block_size_of.clear()


class IdArray:
    """A growable int64 array of the ids in a synthesizer's store, in store order (the ids at a
    position never change, so views handed out stay right after the array grows)."""

    __slots__ = ("_a", "n")

    def __init__(self) -> None:
        self._a = np.empty(1 << 16, np.int64)
        self.n = 0

    def extend(self, ids: list[int]) -> None:
        n, m = self.n, len(ids)
        if n + m > len(self._a):
            a = np.empty(max(2 * len(self._a), n + m), np.int64)
            a[:n] = self._a[:n]
            self._a = a
        self._a[n : n + m] = ids
        self.n = n + m

    def view(self, lo: int, hi: int) -> np.ndarray:
        return self._a[lo:hi]

    def clear(self) -> None:
        self.n = 0


__all__ = ["ChainIds", "IdArray"]
