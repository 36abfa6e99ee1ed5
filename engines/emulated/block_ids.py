"""Block ids as numpy arrays, for the emulated GPU pool (:mod:`engines.emulated.block_pool`) and
the KV manager: the id dtype and helpers, vLLM's free block queue (:class:`FreeBlockQueue`, its
doubly linked list made lazy) and a request's growable block list (:class:`BlockList`). Arrays
because an agentic prompt's thousands of blocks are then touched and freed in a few numpy
operations instead of a Python loop per block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

#: dtype of block-id arrays
BLOCK_ID = np.intp
#: an empty block-id array (no blocks: a miss, nothing allocated)
NO_BLOCKS = np.empty(0, BLOCK_ID)
NO_BLOCKS.flags.writeable = False


def as_block_ids(blocks: Iterable[int]) -> np.ndarray:
    """``blocks`` as a block-id array (arrays pass through; lists, tuples and iterators are copied)."""
    if isinstance(blocks, np.ndarray):
        return blocks
    if not isinstance(blocks, (list, tuple)):
        blocks = list(blocks)
    return np.array(blocks, BLOCK_ID) if blocks else NO_BLOCKS


_POSITIONS = np.arange(1 << 12, dtype=np.int64)


def positions(n: int) -> np.ndarray:
    """``arange(n)`` without allocating one per call."""
    global _POSITIONS
    if n > len(_POSITIONS):
        _POSITIONS = np.arange(max(n, 2 * len(_POSITIONS)), dtype=np.int64)
    return _POSITIONS[:n]


def distinct(ids: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether no id occurs twice in ``ids`` (O(n), no sort: the common case). ``scratch``: an int64
    array longer than the largest id, owned by the caller (its contents are overwritten)."""
    n = len(ids)
    if n < 2:
        return True
    pos = positions(n)
    scratch[ids] = pos
    return bool((scratch[ids] == pos).all())


class FreeBlockQueue:
    """vLLM's ``FreeKVCacheBlockQueue`` (popleft, append, removal from the middle), lazily.

    Appends add *entries* (id, stamp) in chunks; ``stamp[id]`` holds the stamp of a queued block's
    one live entry and -1 when the block is not queued. Removing a block from the middle is then
    one array write (its old entry goes stale), a batch of removals or appends is a handful of
    numpy operations, and popping walks the entries from the head skipping stale ones. Each entry
    is passed over once, so popping is amortized O(1) per block, and the order of live entries is
    exactly the linked list's order. Entries of chunk ``(ids, first)`` carry stamps
    ``first, first + 1, ...``. When stale entries outnumber the blocks the chunks are compacted.
    """

    __slots__ = ("_chunks", "_entries", "_first", "_next", "_off", "num_free", "stamp")

    def __init__(self, num_blocks: int, ids: Sequence[int] | np.ndarray = ()):
        self.stamp = np.full(num_blocks, -1, np.int64)
        self._chunks: deque[tuple[np.ndarray, int]] = deque()
        self._off = 0  # entries of the head chunk already passed over
        self._next = 0  # the next stamp
        self._first = -1  # prepends count down from here (below -1: -1 means "not queued")
        self._entries = 0  # entries not yet passed over, live or stale
        self.num_free = 0
        self.append_many(as_block_ids(ids))

    def append_many(self, ids: np.ndarray) -> None:
        """Append ``ids`` (distinct, none queued) at the tail, in this order."""
        n = len(ids)
        if not n:
            return
        first = self._next
        self.stamp[ids] = np.arange(first, first + n)
        self._chunks.append((ids, first))
        self._next = first + n
        self.num_free += n
        self._entries += n
        if self._entries > 4 * len(self.stamp) + 1024:
            self._compact()

    def prepend_many(self, ids: np.ndarray) -> None:
        """Put ``ids`` (distinct, none queued) at the head, in this order (vLLM's ``prepend_n``)."""
        n = len(ids)
        if not n:
            return
        chunks = self._chunks
        if self._off:  # the head chunk's passed-over entries stay passed over
            head, first = chunks[0]
            chunks[0] = (head[self._off:], first + self._off)
            self._off = 0
        first = self._first - n
        self._first = first
        self.stamp[ids] = np.arange(first, first + n)
        chunks.appendleft((ids, first))
        self.num_free += n
        self._entries += n
        if self._entries > 4 * len(self.stamp) + 1024:
            self._compact()

    def remove_many(self, ids: np.ndarray) -> None:
        """Take ``ids`` (distinct, all queued) out of the queue, wherever they are."""
        self.stamp[ids] = -1
        self.num_free -= len(ids)

    def popleft_many(self, n: int) -> np.ndarray:
        """Pop the first ``n`` queued blocks (the caller checked ``n <= num_free``)."""
        out = self._scan(n, consume=True)
        self.stamp[out] = -1
        self.num_free -= n
        return out

    def peek(self, n: int) -> np.ndarray:
        """The first ``n`` queued blocks (fewer if fewer are queued), left in the queue."""
        return self._scan(min(n, self.num_free), consume=False)

    def block_ids(self) -> list[int]:
        """Head-to-tail ids (tests and debugging; O(entries))."""
        return self.peek(self.num_free).tolist()

    def _scan(self, n: int, consume: bool) -> np.ndarray:
        """The first ``n`` live entries from the head; ``consume`` moves the head past them."""
        if n <= 0:
            return NO_BLOCKS
        chunks, stamp = self._chunks, self.stamp
        # the common case first: the next n entries of the head chunk are all live (a view of them
        # is the answer: four numpy calls, where the general scan below takes about ten)
        ids, first = chunks[0]
        o = self._off
        if o + n <= len(ids):
            window = ids[o : o + n]
            if n == 1:  # decode appends take one block at a time: a scalar probe
                live = stamp[int(window[0])] == first + o
            else:
                live = (stamp[window] == np.arange(first + o, first + o + n)).all()
            if live:
                if consume:
                    self._advance(o + n)
                return window
        parts: list[np.ndarray] = []
        need = n
        c, o = 0, self._off  # chunk index and offset of the scan
        span = max(2 * need, 64)
        while need:
            ids, first = chunks[c]
            size = len(ids)
            w = min(size - o, span)
            window = ids[o : o + w]
            live = np.flatnonzero(stamp[window] == np.arange(first + o, first + o + w))
            if len(live) >= need:
                live = live[:need]
                o += int(live[-1]) + 1
                need = 0
            else:
                need -= len(live)
                o += w
                span *= 2  # stale entries ahead (blocks touched out of the queue): look further at once
            if len(live):
                parts.append(window[live])
            if o == size and need:
                c, o = c + 1, 0
        if consume:
            passed = sum(len(chunks[i][0]) for i in range(c)) - self._off  # whole chunks passed
            for _ in range(c):
                chunks.popleft()
            self._entries -= passed
            self._off = 0
            self._advance(o)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _advance(self, o: int) -> None:
        """Move the head of the first chunk to offset ``o``."""
        self._entries -= o - self._off
        if o == len(self._chunks[0][0]):
            self._chunks.popleft()
            o = 0
        self._off = o

    def _compact(self) -> None:
        """Rebuild the chunks as one chunk of the live entries, in order, with fresh stamps."""
        live = self._scan(self.num_free, consume=False)
        self._chunks.clear()
        self._off = self._entries = 0
        self.num_free = 0
        self.append_many(live.copy())


class BlockList:
    """A request's blocks: a growable block-id array (``view()`` is the ids in order).

    ``distinct``: whether no block is listed twice, as its owner knows it (the KV manager clears it
    when a prefix hit repeats a block); freeing a list known distinct skips checking it again.
    """

    __slots__ = ("_buf", "distinct", "n")

    def __init__(self) -> None:
        self._buf = np.empty(64, BLOCK_ID)
        self.n = 0
        self.distinct = True

    def __len__(self) -> int:
        return self.n

    def extend(self, ids: np.ndarray) -> None:
        n, m = self.n, len(ids)
        end = n + m
        if end > len(self._buf):
            buf = np.empty(max(2 * len(self._buf), end), BLOCK_ID)
            buf[:n] = self._buf[:n]
            self._buf = buf
        self._buf[n:end] = ids
        self.n = end

    def view(self) -> np.ndarray:
        return self._buf[: self.n]
