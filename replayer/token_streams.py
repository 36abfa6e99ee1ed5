"""The token streams of synthesized prompts: which token id sits at a position of a turn's prompt.

A turn's prompt (:mod:`replayer.synth`, "Tokens") is cut from three kinds of stream: the session
model's system prompt, the block of each trace hash id (scoped by namespace), and the turn's own
tail past the ids. Each stream is a counter-based generator: ``splitmix64(key + i * C) % vocab_size``
with ``key`` from BLAKE2b of (seed, stream identity), stable across processes and Python versions
(never Python's ``hash()``), vectorized with numpy, no per-token Python objects. Apart from the
synthesizer because only the token-level paths read them (a live replay's prompts, vLLM's exact
hashes); the simulator's chain ids never synthesize a token.
"""

from __future__ import annotations

import hashlib

import numpy as np

from replayer.trace import Session

_MASK = (1 << 64) - 1
_STEP = np.uint64(0xD1B54A32D192ED03)  # odd constant: consecutive positions land far apart
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on a uint64 array (wraps modulo 2**64 by design)."""
    z = z + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _ids_u64(ids: tuple[int, ...]) -> np.ndarray:
    try:
        return np.fromiter(ids, dtype=np.int64, count=len(ids)).view(np.uint64)
    except OverflowError:  # ids outside int64: reduce modulo 2**64 (a collision is vanishingly unlikely)
        return np.array([h & _MASK for h in ids], dtype=np.uint64)


class TokenStreams:
    """The streams of one seed and vocabulary (stream keys memoized)."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed = seed
        self._vocab = np.uint64(vocab_size)
        self._keys: dict[tuple[str, ...], np.uint64] = {}

    def key(self, *parts: str) -> np.uint64:
        """The key of the stream named by ``parts``."""
        key = self._keys.get(parts)
        if key is None:
            h = hashlib.blake2b(digest_size=8, person=b"gpuhit-synth")
            h.update(str(self.seed).encode())
            for part in parts:
                h.update(b"\x00" + part.encode("utf-8", "surrogatepass"))
            key = np.uint64(int.from_bytes(h.digest(), "big"))
            self._keys[parts] = key
        return key

    def tokens_at(self, session: Session, turn_index: int, start: int, stop: int, system_len: int) -> np.ndarray:
        """Token ids (uint64) at prompt positions ``[start, stop)`` of the turn whose first
        ``system_len`` tokens are its model's system prompt."""
        turn = session.turns[turn_index]
        bs = session.block_size
        pos = np.arange(start, stop, dtype=np.uint64)
        out = np.empty(stop - start, dtype=np.uint64)
        covered = min(len(turn.hash_ids) * bs, turn.input_length)
        # region 3: tail, unique per (namespace, session, turn)
        lo = max(start, covered)
        if lo < stop:
            key = self.key("tail", session.namespace, session.session_id, str(turn_index))
            out[lo - start :] = _mix(key + (pos[lo - start :] - np.uint64(covered)) * _STEP)
        # region 2: hash-id blocks
        hi = min(stop, covered)
        if start < hi:
            first, last = start // bs, (hi - 1) // bs
            ns_key = self.key("block", session.namespace)
            block_keys = _mix(ns_key ^ _mix(_ids_u64(turn.hash_ids[first : last + 1])))
            p = pos[: hi - start]
            bidx = (p // np.uint64(bs)) - np.uint64(first)
            out[: hi - start] = _mix(block_keys[bidx] + (p % np.uint64(bs)) * _STEP)
        # region 1: the model's system prompt replaces the first S tokens
        s_hi = min(stop, system_len)
        if start < s_hi:
            key = self.key("system", session.model)
            out[: s_hi - start] = _mix(key + pos[: s_hi - start] * _STEP)
        return out % self._vocab


__all__ = ["TokenStreams"]
