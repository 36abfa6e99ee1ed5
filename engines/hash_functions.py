"""vLLM's block hash functions (``--prefix-caching-hash-algo``) and the root of every chain,
``NONE_HASH``, bit-exact (what :class:`engines.hashing.BlockHasher` chains).

vLLM hashes a block as ``hash_fn((parent_hash or NONE_HASH, tuple(token_ids), extra_keys))``;
``hash_fn`` is ``sha256`` over ``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)`` (default),
``sha256_cbor`` (canonical CBOR), ``xxhash`` / ``xxhash_cbor`` (128-bit XXH3 of the same encodings;
needs the optional ``xxhash`` package), and ``NONE_HASH = hash_fn(seed)``: the seed is PYTHONHASHSEED
when set, else ``"vllm-none-hash"`` for the sha256 variants and random bytes for the xxhash ones
(vLLM 0.32 ``resolve_none_hash_seed``). KV events carry the last 8 bytes of a digest as a big-endian
unsigned int (:func:`to_event_int`).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
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
