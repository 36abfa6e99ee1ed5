"""vLLM's chained prefix-cache block hash, bit-exact.

vLLM (v1, 0.33 defaults) hashes each *full* block of ``block_size`` tokens as
``hash_fn((parent_hash or NONE_HASH, tuple(token_ids), extra_keys))``; the hash functions and
``NONE_HASH`` are :mod:`engines.hash_functions`. This module chains them over a prompt
(:class:`BlockHasher`), memoizes a session's chain (:class:`SessionHashCache`), hashes lazily
(:class:`PromptHashes`) and searches chains (:func:`common_prefix_len`, :func:`present_run_end`).
KV events carry the last 8 bytes of the digest as a big-endian unsigned int; that 64-bit int is
the form gpuhit uses everywhere outside these modules.

Reference (checked in tests against values computed with vLLM's own code): tokens 1000..1015 ->
``9d9c4137...547aeb68`` -> event int 7322446309363477352.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence
from itertools import islice
from typing import Any

import numpy as np

from engines.hash_functions import get_hash_fn, none_hash_seed, to_event_int
from gpuhit.errors import ConfigError


def common_prefix_len(a: Sequence[Any], b: Sequence[Any], start: int = 0, stop: int | None = None) -> int:
    """How many items ``a`` and ``b`` agree on from ``start`` (up to ``stop``, default the shorter).

    Block-hash chains of one conversation agree on thousands of leading blocks, so the answer is
    found with C-level slice comparisons (all equal in one compare, else a binary search over
    prefix lengths) instead of a Python loop per item. Lists and tuples may be mixed.
    """
    end = min(len(a), len(b)) if stop is None else min(stop, len(a), len(b))
    if end <= start:
        return 0
    sa, sb = a[start:end], b[start:end]
    if type(sa) is not type(sb):
        sa, sb = tuple(sa), tuple(sb)
    if sa == sb:
        return end - start
    # sa[:lo] == sb[:lo]; sa[:hi + 1] != sb[:hi + 1]. Each probe compares only sa[lo:mid], the part
    # in doubt: a prefix compare from 0 would copy ~n/2 items a probe, n log n in all
    lo, hi = 0, end - start - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if sa[lo:mid] == sb[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def present_run_end(hashes: Sequence[Any], table: Container[Any], lo: int, n: int) -> int:
    """Binary search over chain positions: given ``hashes[lo - 1] in table`` (``0 < lo <= n``),
    a ``k`` in ``[lo, n]`` with ``hashes[k - 1]`` in ``table`` and ``k == n`` or ``hashes[k]`` not.

    O(log n) probes. When the present positions of ``hashes[:n]`` are prefix-closed (vLLM frees a
    request's blocks tail first, so a cache nearly always is), ``k`` is the length of the present
    prefix; otherwise the first absent position is somewhere below ``k`` and callers that need the
    exact answer verify ``hashes[lo:k - 1]``.

    A :class:`PromptHashes` not hashed that far is searched from the front instead (galloping:
    positions lo + 1, 2, 4, ... until one is absent, then binary search), so the chain is hashed only
    about twice as far as the present prefix reaches, not to its end.
    """
    if type(hashes) is PromptHashes and hashes.computed < n:
        step = 1
        while True:
            p = min(lo + step, n)
            if hashes[p - 1] not in table:
                hi = p - 1
                break
            lo = p
            if p == n:
                return n
            step <<= 1
    elif hashes[n - 1] in table:
        return n
    else:
        hi = n - 1
    # invariant: hashes[lo - 1] present, hashes[hi] absent
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if hashes[mid - 1] in table:
            lo = mid
        else:
            hi = mid - 1
    return lo


class BlockHasher:
    """Hashes token sequences into vLLM block hashes.

    ``hash_blocks`` returns full digests (needed to chain further blocks); ``event_ints`` the int
    form. Only full blocks are hashed: a trailing partial block is never cached by vLLM.
    """

    __slots__ = ("accel", "block_size", "extra_keys", "hash_fn", "hash_name", "root", "seed")

    def __init__(self, block_size: int = 16, hash_name: str = "sha256", seed: str | None = None,
                 accel: Any = None):
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_name = hash_name
        self.hash_fn = get_hash_fn(hash_name)
        self.seed = none_hash_seed(hash_name, seed)
        self.root = self.hash_fn(self.seed)
        self.extra_keys = None
        self.accel = accel  # the C speedups (gpuhit.speedups.load()) whose chain hash_array uses, or None

    def hash_block(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        return self.hash_fn((parent or self.root, tuple(tokens), self.extra_keys))

    def hash_blocks(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Digests of every full block of ``token_ids``, chained from ``parent`` (None = root)."""
        bs = self.block_size
        out: list[bytes] = []
        h = parent
        tokens = list(token_ids)
        for start in range(0, len(tokens) - bs + 1, bs):
            h = self.hash_block(h, tokens[start : start + bs])
            out.append(h)
        return out

    def event_ints(self, token_ids: Sequence[int], parent: bytes | None = None) -> list[int]:
        return [to_event_int(d) for d in self.hash_blocks(token_ids, parent)]

    def hash_array(self, tokens: np.ndarray, parent: bytes | None = None) -> list[bytes]:
        """``hash_blocks`` of a 1-D integer array, bit-identical: in one C call with the C speedups
        (``accel``: vLLM's sha256 chain, each block's pickle written in C and hashed by OpenSSL,
        ~35x the Python chain's speed), else by the Python chain. The speedups answer None where
        pickle writes another layout (an id >= 2**31, blocks of <= 3 tokens): the Python chain
        decides those."""
        bs = self.block_size
        nb = len(tokens) // bs
        if nb == 0:
            return []
        if self.accel is not None and self.hash_name == "sha256" and self.extra_keys is None:
            h = parent or self.root
            chain = self.accel.sha256_blocks(np.ascontiguousarray(tokens[: nb * bs], dtype=np.uint64), bs, h)
            if chain is not None:
                return chain
        return self.hash_blocks(tokens[: nb * bs].tolist(), parent)


class PromptHashes(Sequence[int]):
    """The event-int block hashes of one token-id prompt, computed on demand.

    Routing needs a prompt's hashes only as far as some instance holds its prefix: the index's
    search (:func:`present_run_end`) probes the chain from the start, so a prompt no instance has
    seen costs one block's hash, not 6,250 (a 100k-token prompt). Whatever has been computed is
    kept, and the next turn of the session reuses it (:class:`SessionHashCache`); :meth:`complete`
    hashes the rest (the gateway calls it after forwarding a request that names its session, so
    the next turn finds the whole chain ready). Reading position ``i`` hashes blocks up to ``i``;
    ``len`` is the number of full blocks and costs nothing.

    The digest and int lists may be handed to the session's next prompt, which then appends its
    own blocks to them: ``_count`` is how many entries belong to this prompt, and a prompt whose
    lists were handed on copies its part before it extends it.
    """

    __slots__ = ("_count", "_digests", "_hasher", "_ints", "_n", "_owner", "superseded", "tokens")

    def __init__(self, hasher: BlockHasher, tokens: Any, digests: list[bytes] | None = None,
                 ints: list[int] | None = None, owner: SessionHashCache | None = None):
        self._hasher = hasher
        # The prompt's ids (uint64), by reference and never modified: a numpy array, or anything
        # whose slices are (gateway.http.token_ids.LazyIds: ids parsed as far as they are hashed).
        self.tokens = tokens
        self._n = len(tokens) // hasher.block_size
        self._digests = [] if digests is None else digests
        self._ints = [] if ints is None else ints
        self._count = len(self._ints)
        self._owner = owner
        self.superseded = False  # a later prompt of the same session came (see :meth:`complete`)

    def __len__(self) -> int:
        return self._n

    @property
    def computed(self) -> int:
        """Blocks hashed so far (from the start of the prompt)."""
        return self._count

    def _ensure(self, k: int) -> None:
        """Hash blocks up to ``k`` (exclusive)."""
        c = self._count
        if k <= c:
            return
        if len(self._ints) != c:  # the lists went on to a later prompt: take a copy of our part
            self._digests = self._digests[:c]
            self._ints = self._ints[:c]
        bs = self._hasher.block_size
        seg = self.tokens[c * bs : k * bs]
        parent = self._digests[c - 1] if c else None
        fresh = self._hasher.hash_array(np.asarray(seg), parent)
        self._digests.extend(fresh)
        self._ints.extend(event_ints_of(fresh))
        self._count = k
        if self._owner is not None:
            self._owner.blocks_hashed += k - c

    def complete(self) -> None:
        """Hash every block not hashed yet, for the session's next prompt; nothing once that prompt
        has come (it took over what was hashed here and hashes what it reads itself: finishing this
        chain then would hash it twice)."""
        if not self.superseded:
            self._ensure(self._n)

    def __getitem__(self, i):  # type: ignore[override]
        n = self._n
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            self._ensure(stop if step > 0 else n)
            return self._ints[: self._count][i] if step <= 0 else self._ints[start:stop:step]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("block index out of range")
        if i >= self._count:
            self._ensure(i + 1)
        return self._ints[i]

    def __iter__(self) -> Iterator[int]:
        self._ensure(self._n)
        return islice(self._ints, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptHashes):
            other = list(other)
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PromptHashes({self._n} blocks, {self._count} hashed)"


class SessionHashCache:
    """Exact block hashes of token-id prompts, per session, lazily and incrementally (LRU of sessions).

    Each session's latest :class:`PromptHashes` is kept; a new prompt of the session finds its
    common prefix with that one's tokens (one vectorized compare, over the blocks already hashed)
    and starts from those digests, so an agentic turn that appends 512 tokens to a 100k-token
    prompt hashes at most 32 blocks, and a prompt no instance has seen hashes as few as routing asks
    for. The session key is ``session``, else the first block's tokens.

    Bounded twice (least recently used first): at most ``max_sessions`` sessions and at most
    ``max_tokens`` tokens kept in all (a kept 100k-token prompt holds its ids and digests, ~1.4 MB:
    4,096 of them would be 5.6 GB; the default 16M tokens is ~250 MB). The session in use is never
    evicted by its own prompt.
    """

    def __init__(self, hasher: BlockHasher, max_sessions: int = 4096, max_tokens: int = 16 << 20):
        if max_sessions <= 0 or max_tokens <= 0:
            raise ConfigError("the session hash cache needs max_sessions > 0 and max_tokens > 0")
        self.hasher = hasher
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._entries: OrderedDict[Any, PromptHashes] = OrderedDict()
        self.tokens = 0  # tokens of the kept prompts
        self.blocks_hashed = 0  # work counter (tests, /debug/state, benchmarks)

    def hashes(self, token_ids: Sequence[int], session: str | None = None, packed: array | None = None
               ) -> PromptHashes:
        """:meth:`hashes_array` of a token list. ``packed`` = ``array('Q', token_ids)`` if the
        caller already has it (the gateway builds it to validate the ids)."""
        if packed is None:
            packed = array("Q", token_ids)
        return self.hashes_array(np.frombuffer(packed, dtype=np.uint64), session)

    def hashes_array(self, ids: Any, session: str | None = None) -> PromptHashes:
        """The lazily hashed blocks of a 1-D uint64 array, or of ids whose slices are such arrays
        (kept by reference: the caller must not modify them afterwards)."""
        hasher = self.hasher
        bs = hasher.block_size
        nfull = len(ids) // bs
        if nfull == 0:
            return PromptHashes(hasher, ids, owner=self)
        key: Any = session if session is not None else tuple(ids[:bs].tolist())
        last = self._entries.get(key)
        if last is None:
            out = PromptHashes(hasher, ids, owner=self)
        else:
            last.superseded = True
            m = min(last.computed, nfull)
            if m and ids is not last.tokens:  # the same ids object (a repeated prompt) needs no compare
                diff = np.flatnonzero(ids[: m * bs] != last.tokens[: m * bs])
                if len(diff):
                    m = int(diff[0]) // bs
            if m == last.computed and len(last._ints) == m:  # extends it: take its lists over, no copies
                out = PromptHashes(hasher, ids, last._digests, last._ints, owner=self)
            else:
                out = PromptHashes(hasher, ids, last._digests[:m], last._ints[:m], owner=self)
        # The session's latest prompt is the best predictor of its next one.
        entries = self._entries
        if last is not None:
            self.tokens -= len(last.tokens)
        entries[key] = out
        entries.move_to_end(key)
        self.tokens += len(ids)
        while len(entries) > 1 and (len(entries) > self.max_sessions or self.tokens > self.max_tokens):
            self.tokens -= len(entries.popitem(last=False)[1].tokens)
        return out


def event_ints_of(digests: Sequence[bytes]) -> list[int]:
    """``[to_event_int(d) for d in digests]`` in a few C passes (digests of one length)."""
    n = len(digests)
    if n < 8:  # numpy's fixed cost exceeds a few int conversions (routing a new prompt hashes one block)
        return [int.from_bytes(d[-8:], "big") for d in digests]
    raw = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(n, -1)[:, -8:]
    return np.ascontiguousarray(raw).view(">u8").ravel().tolist()
