"""vLLM's chained prefix-cache block hash, bit-exact.

vLLM (v1, 0.33 defaults) hashes each *full* block of ``block_size`` tokens as
``hash_fn((parent_hash or NONE_HASH, tuple(token_ids), extra_keys))`` where ``hash_fn`` is
``sha256`` over ``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)`` (default), ``sha256_cbor``
(canonical CBOR), ``xxhash`` / ``xxhash_cbor`` (128-bit XXH3 of the same encodings; needs the optional
``xxhash`` package), and ``NONE_HASH = hash_fn(seed)``: the seed is PYTHONHASHSEED when set, else
``"vllm-none-hash"`` for the sha256 variants and random bytes for the xxhash ones (vLLM 0.32
``resolve_none_hash_seed``). KV events carry the last 8 bytes of the digest as a
big-endian unsigned int; that 64-bit int is the form gpuhit uses everywhere outside this module.

Reference (checked in tests against values computed with vLLM's own code): tokens 1000..1015 ->
``9d9c4137...547aeb68`` -> event int 7322446309363477352.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from typing import Any

from gpuhit.errors import ConfigError

HashFn = Callable[[Any], bytes]


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the highest-protocol pickle of ``obj``."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR encoding (language-independent)."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash
    except ImportError:
        raise ConfigError(
            "the engines' --prefix-caching-hash-algo xxhash / xxhash_cbor needs the `xxhash` package in the "
            "gateway too (pip install 'gpuhit[xxhash]')"
        ) from None
    return xxhash.xxh3_128_digest(data)


def xxhash_pickle(obj: Any) -> bytes:
    """vLLM's ``xxhash``: 128-bit XXH3 of the highest-protocol pickle of ``obj``."""
    return _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """vLLM's ``xxhash_cbor``: 128-bit XXH3 of the canonical CBOR encoding."""
    import cbor2

    return _xxh3_128(cbor2.dumps(obj, canonical=True))


# vLLM's --prefix-caching-hash-algo names (vllm/utils/hashing.py: get_hash_fn_by_name).
HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": sha256_pickle, "sha256_cbor": sha256_cbor, "xxhash": xxhash_pickle, "xxhash_cbor": xxhash_cbor,
}
# Not collision resistant: vLLM seeds NONE_HASH with random bytes for these unless PYTHONHASHSEED is set.
NON_CRYPTO = frozenset({"xxhash", "xxhash_cbor"})
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def get_hash_fn(name: str) -> HashFn:
    try:
        fn = HASH_FUNCTIONS[name]
    except KeyError:
        raise ConfigError(f"unknown prefix-caching hash {name!r}; choose one of {sorted(HASH_FUNCTIONS)}") from None
    if name in NON_CRYPTO:
        fn(b"")  # fail now, with the install hint, if xxhash is missing
    return fn


def none_hash_seed(hash_name: str, seed: str | None = None) -> str:
    """The seed vLLM derives ``NONE_HASH`` from (``resolve_none_hash_seed``): the engines'
    ``PYTHONHASHSEED`` when set (``seed``, else this process's own ``PYTHONHASHSEED``), else the fixed
    ``"vllm-none-hash"`` for sha256 / sha256_cbor. The xxhash algorithms without PYTHONHASHSEED use a
    random per-process seed that nobody else can know: refused with a clear error."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if hash_name in NON_CRYPTO:
        raise ConfigError(
            f"vLLM with --prefix-caching-hash-algo {hash_name} and no PYTHONHASHSEED seeds its block hashes with "
            f"random bytes, so no gateway can predict them: start the engines with PYTHONHASHSEED=<s> and give the "
            f"gateway the same value (--hash-seed <s>), or use sha256"
        )
    return DEFAULT_NONE_HASH_SEED


def none_hash(hash_fn: HashFn, seed: str | None = None) -> bytes:
    """The root parent hash, as vLLM's ``init_none_hash`` computes it (``seed`` None: this process's
    ``PYTHONHASHSEED``, else ``"vllm-none-hash"``)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    return hash_fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)


def to_event_int(digest: bytes) -> int:
    """The int form of a block hash in vLLM's KV events: last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


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
    lo, hi = 0, end - start - 1  # sa[:lo] == sb[:lo]; sa[:hi + 1] != sb[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if sa[:mid] == sb[:mid]:
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
    """
    if hashes[n - 1] in table:
        return n
    hi = n - 1  # invariant: hashes[lo - 1] present, hashes[hi] absent
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

    __slots__ = ("block_size", "extra_keys", "hash_fn", "hash_name", "root", "seed")

    def __init__(self, block_size: int = 16, hash_name: str = "sha256", seed: str | None = None):
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_name = hash_name
        self.hash_fn = get_hash_fn(hash_name)
        self.seed = none_hash_seed(hash_name, seed)
        self.root = self.hash_fn(self.seed)
        self.extra_keys = None

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


class _Entry:
    __slots__ = ("digests", "ints", "tokens")

    def __init__(self) -> None:
        self.tokens = b""  # the session's last prompt (full blocks) as packed uint64s
        self.digests: list[bytes] = []
        self.ints: list[int] = []


class SessionHashCache:
    """Exact block hashes of token-id prompts, computed incrementally per session (LRU of sessions).

    Prompts are compared as packed ``array('Q')`` bytes: finding the common prefix with the
    session's previous prompt is a few C ``memcmp`` calls (binary search over blocks), never a
    Python loop over tokens.
    """

    def __init__(self, hasher: BlockHasher, max_sessions: int = 4096):
        self.hasher = hasher
        self.max_sessions = max_sessions
        self._entries: OrderedDict[Any, _Entry] = OrderedDict()
        self.blocks_hashed = 0  # work counter (tests and benchmarks)

    def hashes(self, token_ids: Sequence[int], session: str | None = None, packed: array | None = None) -> list[int]:
        """Event-int hashes of every full block. ``packed`` = ``array('Q', token_ids)`` if the
        caller already has it (the gateway builds it to validate the ids)."""
        bs = self.hasher.block_size
        nfull = len(token_ids) // bs
        if nfull == 0:
            return []
        key: Any = session if session is not None else tuple(token_ids[:bs])
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry()
            self._entries[key] = entry
            if len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        if packed is None:
            packed = array("Q", token_ids)
        new = packed.tobytes()[: nfull * bs * 8]
        old = entry.tokens
        step = bs * 8
        m = min(len(entry.digests), nfull)
        if m and new[: m * step] != old[: m * step]:
            lo, hi = 0, m - 1  # largest k < m whose first k blocks are equal
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if new[: mid * step] == old[: mid * step]:
                    lo = mid
                else:
                    hi = mid - 1
            m = lo
        digests = entry.digests[:m]
        ints = entry.ints[:m]
        parent = digests[-1] if digests else None
        hash_block = self.hasher.hash_block
        for start in range(m * bs, nfull * bs, bs):
            parent = hash_block(parent, token_ids[start : start + bs])
            digests.append(parent)
            ints.append(to_event_int(parent))
        self.blocks_hashed += nfull - m
        # The session's latest prompt is the best predictor of its next one.
        entry.tokens = new
        entry.digests = digests
        entry.ints = ints
        return ints
