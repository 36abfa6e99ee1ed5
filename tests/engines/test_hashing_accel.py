"""The C speedups' vLLM sha256 block-hash chain (gpuhit/_speedups.c, hashed by OpenSSL) against
BlockHasher's Python chain: the same digests for every input, None where the Python path must decide.
Built for the test run by the ``c_speedups`` fixture (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.hashing import BlockHasher


def _ids(rng: np.random.Generator, n: int) -> np.ndarray:
    # ids on both sides of each pickle width (BININT1 < 256 <= BININT2 < 65536 <= BININT < 2**31)
    edges = np.array([0, 1, 127, 128, 255, 256, 257, 65535, 65536, 65537, (1 << 31) - 1], dtype=np.uint64)
    pick = rng.integers(0, 4, n)
    out = np.where(pick == 0, edges[rng.integers(0, len(edges), n)],
                   rng.integers(0, [256, 65536, 1 << 31][rng.integers(0, 3)], n).astype(np.uint64))
    return out.astype(np.uint64)


def test_block_chain_equals_the_python_chain(c_speedups):
    rng = np.random.default_rng(3)
    for trial in range(400):
        bs = int(rng.choice([4, 5, 16, 17, 32, 64]))
        ids = _ids(rng, int(rng.integers(0, 12 * bs)))
        hasher = BlockHasher(bs)
        parent = rng.bytes(32) if trial % 3 == 0 else hasher.root
        nb = len(ids) // bs
        got = c_speedups.sha256_blocks(ids[: nb * bs], bs, parent)
        assert got == hasher.hash_blocks(ids.tolist(), None if parent == hasher.root else parent), trial
        # a trailing partial block is not hashed
        assert c_speedups.sha256_blocks(ids, bs, parent) == got


def test_block_chain_leaves_what_it_cannot_lay_out_to_python(c_speedups):
    root = BlockHasher(16).root
    big = np.arange(16, dtype=np.uint64)
    big[5] = 1 << 31  # pickled as LONG1 by Python, not BININT
    assert c_speedups.sha256_blocks(big, 16, root) is None
    assert c_speedups.sha256_blocks(np.arange(6, dtype=np.uint64), 3, root) is None  # TUPLE3, no MARK
    with pytest.raises(TypeError, match="uint64"):
        c_speedups.sha256_blocks(np.arange(16, dtype=np.int32), 16, root)
    with pytest.raises(ValueError, match="32 bytes"):
        c_speedups.sha256_blocks(np.arange(16, dtype=np.uint64), 16, root[:31])
    with pytest.raises(ValueError, match="positive"):
        c_speedups.sha256_blocks(np.arange(16, dtype=np.uint64), 0, root)


def test_hash_array_takes_the_c_chain_and_agrees(c_speedups):
    """BlockHasher.hash_array given the speedups gives what it gives without them, chained from the
    root or from a parent, on the fast path and around it."""
    rng = np.random.default_rng(11)
    cases = [(_ids(rng, n), p) for n in (16, 100, 1600, 20_000) for p in (None, rng.bytes(32))]
    want = [BlockHasher(16).hash_array(ids, p) for ids, p in cases]  # the Python chain
    calls = []
    real = c_speedups.sha256_blocks

    class Spy:
        def sha256_blocks(self, *args):
            calls.append(len(args[0]))
            return real(*args)

    hasher = BlockHasher(16, accel=Spy())
    assert [hasher.hash_array(ids, p) for ids, p in cases] == want
    assert calls == [16, 16, 96, 96, 1600, 1600, 20_000, 20_000]
    assert [hasher.hash_blocks(ids.tolist(), p) for ids, p in cases] == want
    # the rest of a prompt from its tenth block on, chained from the ninth (a view into the array)
    assert hasher.hash_array(cases[6][0][160:], want[6][9]) == want[6][10:]
    # an id of 2**31: the C chain declines, the Python path hashes it as vLLM does
    big = cases[4][0].copy()
    big[100] = 1 << 31
    assert hasher.hash_array(big) == hasher.hash_blocks(big.tolist())
    assert calls[-1] == 1600
