"""vLLM's chained block hash: the DESIGN.md reference vector, hash choices and PYTHONHASHSEED."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from engines.hash_functions import get_hash_fn, none_hash, sha256_cbor, sha256_pickle, to_event_int
from engines.hashing import BlockHasher
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


def test_xxhash_algorithms_follow_vllm_formula():
    xxhash = pytest.importorskip("xxhash")
    from engines.hash_functions import xxhash_cbor, xxhash_pickle

    obj = (b"root", (1, 2, 3), None)
    assert xxhash_pickle(obj) == xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    import cbor2

    assert xxhash_cbor(obj) == xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))
    h = BlockHasher(16, "xxhash", seed="0")
    assert h.root == xxhash_pickle("0")
    assert h.event_ints(range(16)) == [to_event_int(xxhash_pickle((h.root, tuple(range(16)), None)))]


def test_xxhash_without_a_seed_is_refused():
    # vLLM seeds NONE_HASH with random bytes for xxhash unless PYTHONHASHSEED is set: unpredictable.
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        BlockHasher(16, "xxhash_cbor")


def test_hashes_equal_vllm_own_code():
    """sha256 and sha256_cbor with and without a seed, against vLLM 0.32's own vllm/utils/hashing.py,
    run by the vLLM venv's python (skipped without it)."""
    import json
    import subprocess

    from engines.vllm.venv import vllm_python

    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM venv")
    script = r'''
import importlib.util, json, pathlib, sys, vllm.utils as u  # vllm.utils: no torch import
spec = importlib.util.spec_from_file_location("h", pathlib.Path(u.__file__).with_name("hashing.py"))
h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)
out = {}
for algo in ("sha256", "sha256_cbor"):
    fn = h.get_hash_fn_by_name(algo)
    for seed in (None, "0"):
        root = fn("vllm-none-hash" if seed is None else seed)
        b0 = fn((root, tuple(range(1000, 1032)), None)); b1 = fn((b0, tuple(range(1032, 1064)), None))
        out[f"{algo}/{seed}"] = [int.from_bytes(b0, "big") & (2**64 - 1), int.from_bytes(b1, "big") & (2**64 - 1)]
print(json.dumps(out))
'''
    try:
        ref = json.loads(subprocess.run([str(py), "-c", script], capture_output=True, text=True, check=True,
                                        timeout=120).stdout)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"vLLM reference script failed: {exc.stderr[-2000:]}")
    for key, want in ref.items():
        algo, seed = key.split("/")
        assert BlockHasher(32, algo, None if seed == "None" else seed).event_ints(range(1000, 1064)) == want, key
