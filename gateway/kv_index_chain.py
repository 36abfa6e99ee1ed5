"""The precise KV index for chain ids: each block's instances as the bits of one word, in an array.

Same answers as :class:`gateway.kv_index.PreciseKVIndex` (the GPU prefix hit is the run of a prompt's
blocks present on an instance from its first; the CPU hit the run present in that instance's CPU
tier from there), for the simulator, whose block identities are the replayer's chain ids: small
non-negative integers handed out in order (:mod:`replayer.chain_ids`). An id indexes an array
directly, so each tier is one array of words over the ids, bit ``i`` set while instance ``i``
holds the block (one array of words per 64 instances); a run of 3.3 million ids (all 180 WEKA
conversations at block size 16) is 3.3 MB per tier for up to 8 instances.

Why: in a simulated run every computed block is stored and later evicted, tens of millions of KV
events, and every request asks all instances for its thousands-long prefix. As Python sets those
were ~15% of a run (the probes of a multi-million-entry set are cache misses); as arrays an
event's batch is two numpy operations on the int64 ids the block pool already has (its events
carry arrays in virtual time, :class:`engines.emulated.block_pool.BlockPool`), and a prompt's
prefix hits on every instance at once are one gather, one running AND and one look at where the
words change (a bit turns off once, so at most one change per instance).

The last word of each array is never set: ids past it are clipped onto it, so an id never stored
reads as absent without a bounds check.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from engines.keyed_hashes import chain_id_array, keys_of
from engines.kv_events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gpuhit.errors import ConfigError

#: the instances one word holds; more take one array of words per 64 instances
WORD_BITS = 64


def _word(n: int) -> type[np.unsignedinteger]:
    for dt in (np.uint8, np.uint16, np.uint32):
        if n <= np.iinfo(dt).bits:
            return dt
    return np.uint64


def _as_keys(hashes: Any) -> np.ndarray:
    """``hashes`` as int64 chain ids (ConfigError for anything that is not one)."""
    if isinstance(hashes, np.ndarray):
        return hashes
    keys = keys_of(hashes)
    if keys is not None:
        return keys
    return chain_id_array(hashes, "the chain-id KV index needs them; use PreciseKVIndex for vLLM's hashes")


class _Bits:
    """One tier: ``words[g][id]`` has bit ``i`` set while instance ``64 g + i`` holds block ``id``
    (one array of words per 64 instances: one array up to 64)."""

    __slots__ = ("used", "words")

    def __init__(self, dtype: type[np.unsignedinteger], size: int, groups: int) -> None:
        self.words = [np.zeros(max(size, 2), dtype) for _ in range(groups)]
        self.used = False  # any block ever stored (a tier never used answers 0 without a look)

    def limit(self) -> int:
        return len(self.words[0]) - 1  # the last word stays 0 (see the module docstring)

    def grow(self, top: int) -> None:
        """Room for id ``top``."""
        if top >= self.limit():
            for g, old in enumerate(self.words):
                words = np.zeros(max(2 * len(old), top + 2), old.dtype)
                words[: len(old)] = old
                self.words[g] = words

    def store(self, keys: np.ndarray, g: int, bit: np.unsignedinteger) -> None:
        if not len(keys):
            return
        self.grow(int(keys.max()))
        w = self.words[g]
        w[keys] |= bit
        self.used = True

    def remove(self, keys: np.ndarray, g: int, nbit: np.unsignedinteger) -> None:
        if not len(keys):
            return
        if int(keys.max()) >= self.limit():  # never stored: absent already
            keys = keys[keys < self.limit()]
        w = self.words[g]
        w[keys] &= nbit


class ChainIdKVIndex:
    """:class:`gateway.kv_index.KVIndex` over chain ids, fed by the engines' KV events (GPU and CPU
    media; others ignored, as :class:`~gateway.kv_index.PreciseKVIndex` does)."""

    learns_from_routing = False  # on_routed is a no-op: the router skips calling it

    def __init__(self, num_instances: int, size: int = 1 << 16):
        if num_instances <= 0:
            raise ConfigError(f"a KV index needs at least one instance, got {num_instances}")
        self.num_instances = num_instances
        dtype = _word(num_instances)
        self._groups = -(-num_instances // WORD_BITS)
        self._bit = [dtype(1 << (i % WORD_BITS)) for i in range(num_instances)]
        self._nbit = [~b for b in self._bit]
        self._gpu = _Bits(dtype, size, self._groups)
        self._cpu = _Bits(dtype, size, self._groups)

    def _check(self, instance: int) -> None:
        if not 0 <= instance < self.num_instances:
            raise ConfigError(f"instance {instance} out of range 0..{self.num_instances - 1}")

    # ---- queries -------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        n_inst = self.num_instances
        n = len(block_hashes)
        if not n or not self._gpu.used:
            return [(0, 0)] * n_inst if not n or not self._cpu.used else self._with_cpu([0] * n_inst, block_hashes)
        keys = _as_keys(block_hashes)
        hits = [0] * n_inst
        for g, words in enumerate(self._gpu.words):
            base = g * WORD_BITS
            acc = np.bitwise_and.accumulate(words.take(keys, mode="clip"))
            prev = int(acc[0])
            if not prev:
                continue
            # a bit turns off once (the running AND only loses bits): the positions where the word
            # changes are where instances' runs end
            for p in (np.flatnonzero(acc[1:] != acc[:-1]) + 1).tolist():
                cur = int(acc[p])
                gone, prev = prev & ~cur, cur
                while gone:
                    low = gone & -gone
                    hits[base + low.bit_length() - 1] = p
                    gone ^= low
            while prev:
                low = prev & -prev
                hits[base + low.bit_length() - 1] = n
                prev ^= low
        if self._cpu.used:
            return self._with_cpu(hits, block_hashes)
        return [(g, 0) for g in hits]

    def _with_cpu(self, hits: list[int], block_hashes: Sequence[int]) -> list[tuple[int, int]]:
        keys = _as_keys(block_hashes)
        return [(g, self._run(self._cpu, keys, g, i)) for i, g in enumerate(hits)]

    def _run(self, tier: _Bits, keys: np.ndarray, start: int, i: int) -> int:
        """Length of the run of ``keys[start:]`` present in ``tier`` on instance ``i``."""
        if start >= len(keys) or not tier.used:
            return 0
        present = (tier.words[i // WORD_BITS].take(keys[start:], mode="clip") & self._bit[i]) != 0
        return len(present) if present.all() else int(present.argmin())

    def match_one(self, instance: int, block_hashes: Sequence[int]) -> tuple[int, int]:
        self._check(instance)
        if not len(block_hashes):
            return (0, 0)
        keys = _as_keys(block_hashes)
        g = self._run(self._gpu, keys, 0, instance)
        return (g, self._run(self._cpu, keys, g, instance))

    def cached(self, instance: int, medium: str = GPU) -> set[int]:
        self._check(instance)
        tier = self._tier(medium)
        if tier is None:
            raise ConfigError(f"unknown medium {medium!r}; the index tracks GPU and CPU")
        return set(np.flatnonzero(tier.words[instance // WORD_BITS] & self._bit[instance]).tolist())

    # ---- updates -------------------------------------------------------------------------------
    def on_kv_event(self, instance: int, batch: KVEventBatch) -> None:
        self._check(instance)
        g, bit, nbit = instance // WORD_BITS, self._bit[instance], self._nbit[instance]
        # consecutive removals from one tier are applied together (a decode stretch publishes one
        # BlockRemoved per block); a store in between applies them first, as the events are ordered
        run: list[Any] = []
        run_tier: _Bits | None = None
        for ev in batch.events:
            if isinstance(ev, BlockRemoved):
                tier = self._tier(ev.medium)
                if tier is None:
                    continue
                if tier is not run_tier and run:
                    self._remove_run(run_tier, run, g, nbit)  # type: ignore[arg-type]
                    run = []
                run_tier = tier
                run.append(ev.block_hashes)
                continue
            if run:
                self._remove_run(run_tier, run, g, nbit)  # type: ignore[arg-type]
                run = []
            if isinstance(ev, BlockStored):
                tier = self._tier(ev.medium)
                if tier is not None:
                    tier.store(_as_keys(ev.block_hashes), g, bit)
            elif isinstance(ev, AllBlocksCleared):
                if ev.medium in (None, GPU):
                    self._gpu.words[g] &= nbit
                if ev.medium in (None, CPU):
                    self._cpu.words[g] &= nbit
            else:  # the decoder only produces the three types; anything else is a bug upstream
                raise ConfigError(f"unknown KV event {type(ev).__name__}")
        if run:
            self._remove_run(run_tier, run, g, nbit)  # type: ignore[arg-type]

    @staticmethod
    def _remove_run(tier: _Bits, run: list[Any], g: int, nbit: np.unsignedinteger) -> None:
        if len(run) == 1:
            tier.remove(_as_keys(run[0]), g, nbit)
        elif all(type(h) is tuple for h in run):
            tier.remove(_as_keys([x for h in run for x in h]), g, nbit)
        else:
            tier.remove(np.concatenate([_as_keys(h) for h in run]), g, nbit)

    def on_routed(self, instance: int, block_hashes: Sequence[int]) -> None:
        """Nothing to learn: the engine's events are the truth."""

    def _tier(self, medium: str | None) -> _Bits | None:
        if medium is None or medium == GPU:
            return self._gpu
        if medium == CPU:
            return self._cpu
        return None


__all__ = ["WORD_BITS", "ChainIdKVIndex"]
