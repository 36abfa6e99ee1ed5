"""vLLM's chained block hash: the DESIGN.md reference vector, hash choices and PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from engines.hashing import BlockHasher, get_hash_fn, none_hash, sha256_cbor, sha256_pickle, to_event_int
from gpuhit.errors import ConfigError


@pytest.fixture(autouse=True)
def _no_hash_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def test_reference_vector():
    h = BlockHasher(16)
    d0, d1 = h.hash_blocks(list(range(1000, 1032)))
    assert d0.hex().startswith("9d9c4137") and d0.hex().endswith("547aeb68")
    assert to_event_int(d0) == 7322446309363477352
    assert to_event_int(d1) == 17027874615116373601
    assert h.event_ints(range(1000, 1032)) == [7322446309363477352, 17027874615116373601]
    # chaining from the first digest gives the second block alone
    assert h.event_ints(range(1016, 1032), parent=d0) == [17027874615116373601]


def test_root_is_sha256_of_pickled_marker():
    expected = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert none_hash(sha256_pickle) == expected == BlockHasher(16).root


def test_partial_block_is_not_hashed():
    h = BlockHasher(16)
    assert h.event_ints(range(1000, 1031)) == [7322446309363477352]
    assert h.event_ints(range(15)) == []


def test_sha256_cbor_is_deterministic_and_distinct():
    a = BlockHasher(16, "sha256_cbor").event_ints(range(1000, 1032))
    assert a == BlockHasher(16, "sha256_cbor").event_ints(range(1000, 1032))
    assert a != BlockHasher(16).event_ints(range(1000, 1032))
    assert sha256_cbor((b"x", (1, 2), None)) == sha256_cbor((b"x", (1, 2), None))
    assert get_hash_fn("sha256_cbor") is sha256_cbor


def test_pythonhashseed_changes_the_root(monkeypatch):
    unset = BlockHasher(16).event_ints(range(1000, 1016))
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    seeded = BlockHasher(16)
    assert seeded.root == sha256_pickle("42")
    assert seeded.event_ints(range(1000, 1016)) != unset
    assert BlockHasher(16).event_ints(range(1000, 1016)) == seeded.event_ints(range(1000, 1016))
    # an explicit seed wins over the environment
    assert BlockHasher(16, seed="7").root == sha256_pickle("7") != seeded.root


def test_bad_hash_name_and_block_size():
    with pytest.raises(ConfigError, match="unknown prefix-caching hash 'md5'"):
        BlockHasher(16, "md5")
    with pytest.raises(ConfigError, match="block_size must be positive"):
        BlockHasher(0)


def test_common_prefix_len_matches_a_plain_scan():
    import random

    from engines.hashing import common_prefix_len

    def naive(a, b, start, stop):
        end = min(len(a), len(b)) if stop is None else min(stop, len(a), len(b))
        i = start
        while i < end and a[i] == b[i]:
            i += 1
        return max(i - start, 0)

    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(0, 40)
        a = [rng.randint(0, 3) for _ in range(n)]
        b = a[: rng.randint(0, n)] + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        start = rng.randint(0, 45)
        stop = rng.choice((None, rng.randint(0, 50)))
        for x, y in ((a, b), (tuple(a), b), (b, tuple(a))):  # lists and tuples mixed
            assert common_prefix_len(x, y, start, stop) == naive(list(x), list(y), start, stop)
