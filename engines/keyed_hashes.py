"""A prompt's block hashes as a tuple that also carries them as one int64 array.

Why: in virtual time the block identities are the replayer's chain ids (small non-negative ints,
:mod:`replayer.synth`), and the parts that take a prompt's hashes in bulk (the simulator's KV index,
:mod:`gateway.kv_index_chain`; the block pool's caching) work on int64 arrays. Converting a
thousands-long tuple of Python ints to an array costs ~20 ns a block, about what the array work
itself saves; the synthesizer has the ids in an array already, so it hands both over at once.
Everything else sees a plain tuple (slicing one gives plain tuples).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Self

import numpy as np

from gpuhit.errors import ConfigError


class KeyedHashes(tuple):
    """A tuple of chain ids whose ``array`` holds the same ids as a read-only int64 array."""

    array: np.ndarray

    def __new__(cls, hashes: Iterable[int], array: np.ndarray | None = None) -> Self:
        self = super().__new__(cls, hashes)
        if array is None:
            array = np.fromiter(self, np.int64, len(self))
        if len(array) != len(self):
            raise ValueError(f"KeyedHashes: {len(self)} hashes but an array of {len(array)}")
        array.flags.writeable = False
        self.array = array
        return self


def keys_of(hashes: object) -> np.ndarray | None:
    """The int64 array a :class:`KeyedHashes` carries, else None."""
    return getattr(hashes, "array", None) if type(hashes) is KeyedHashes else None


def chain_id_array(hashes: Sequence[int], remedy: str) -> np.ndarray:
    """``hashes`` as int64 chain ids; a ConfigError naming ``remedy`` for any that is not one
    (negative, or beyond int64: vLLM's 64-bit hashes, say)."""
    try:
        keys = np.fromiter(hashes, np.int64, len(hashes))
    except OverflowError:
        keys = None
    if keys is None or (len(keys) and int(keys.min()) < 0):
        raise ConfigError(f"given hashes that are not chain ids (negative or beyond int64): {remedy}")
    return keys


__all__ = ["KeyedHashes", "chain_id_array", "keys_of"]
