"""A prompt's chain ids as one read-only int64 array, with the sequence interface of its hashes.

Why: in virtual time the block identities are the replayer's chain ids (small non-negative ints,
:mod:`replayer.synth`), and the parts that take a prompt's hashes in bulk (the simulator's KV index,
:mod:`gateway.kv_index_chain`; the block pool's caching; the KV manager's run check) work on int64
arrays. A request carries its thousands of ids as that array only: a tuple of Python ints beside it
cost a copy of thousands of references per request (building, slicing and freeing it), for the few
single ids the rest reads (a lookup's binary search, the block before a cached run). Those come out
as Python ints; a slice is a view of the same array; iterating yields Python ints.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from gpuhit.errors import ConfigError


class KeyedHashes(Sequence[int]):
    """Chain ids as a read-only int64 ``array`` (a view, never copied by slicing)."""

    __slots__ = ("array",)

    array: np.ndarray

    def __init__(self, ids: np.ndarray | Sequence[int]) -> None:
        if not isinstance(ids, np.ndarray):
            ids = chain_id_array(ids, "KeyedHashes holds chain ids only")
        elif ids.dtype != np.int64 or ids.ndim != 1:
            raise ConfigError(f"KeyedHashes needs a 1-D int64 array, got {ids.dtype} of {ids.ndim} dimensions")
        if ids.flags.writeable:
            ids = ids.view()
            ids.flags.writeable = False
        self.array = ids

    def __len__(self) -> int:
        return len(self.array)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> KeyedHashes: ...

    def __getitem__(self, i: Any) -> Any:
        if type(i) is slice:
            return KeyedHashes(self.array[i])
        return int(self.array[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def __eq__(self, other: object) -> bool:
        if type(other) is KeyedHashes:
            return bool(np.array_equal(self.array, other.array))
        if isinstance(other, (tuple, list)):
            return len(other) == len(self.array) and self.array.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to tuples, so no hash of its own

    def __repr__(self) -> str:
        return f"KeyedHashes({self.array.tolist()!r})"


def keys_of(hashes: object) -> np.ndarray | None:
    """The int64 array a :class:`KeyedHashes` carries, else None."""
    return hashes.array if type(hashes) is KeyedHashes else None


def chain_id_array(hashes: Sequence[int], remedy: str) -> np.ndarray:
    """``hashes`` as int64 chain ids; a ConfigError naming ``remedy`` for any that is not one
    (negative, or beyond int64: vLLM's 64-bit hashes, say). A :class:`KeyedHashes` gives its array."""
    if type(hashes) is KeyedHashes:
        return hashes.array
    try:
        keys = np.fromiter(hashes, np.int64, len(hashes))
    except OverflowError:
        keys = None
    if keys is None or (len(keys) and int(keys.min()) < 0):
        raise ConfigError(f"given hashes that are not chain ids (negative or beyond int64): {remedy}")
    return keys


__all__ = ["KeyedHashes", "chain_id_array", "keys_of"]
