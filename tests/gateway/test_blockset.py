"""The C speedups' ``BlockSet`` (gpuhit/_blockset.c) answers as a Python set of ints does, for every
operation the precise KV index uses, over random operations on keys that collide, wrap around the
table's end and cross its resizes. Built for the test run by the ``c_speedups`` fixture."""

from __future__ import annotations

import random

import pytest

TOP = 2**64 - 1


def _keys(rng: random.Random, pool: list[int]) -> int:
    # Mostly a small pool (so removes and repeats hit, and a small table collides and wraps), with the
    # edges: 0 (kept in a flag, not the table) and 2**64 - 1.
    r = rng.random()
    if r < 0.05:
        return rng.choice([0, TOP, 1, True])
    if r < 0.85:
        return rng.choice(pool)
    return rng.getrandbits(64)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_answer_as_a_python_set(c_speedups, seed):
    rng = random.Random(seed)
    pool = [rng.getrandbits(64) for _ in range(rng.choice([20, 100, 3000]))]
    mine = c_speedups.BlockSet(reserve=rng.choice([0, 0, 10, 5000]))
    ref: set[int] = set()
    for step in range(20_000):
        op = rng.random()
        k = _keys(rng, pool)
        if op < 0.25:
            mine.add(k)
            ref.add(k)
        elif op < 0.45:
            mine.discard(k)
            ref.discard(k)
        elif op < 0.55:
            if k in ref:
                mine.remove(k)
                ref.remove(k)
            else:
                with pytest.raises(KeyError):
                    mine.remove(k)
        elif op < 0.7:
            batch = [_keys(rng, pool) for _ in range(rng.randint(0, 80))]
            mine.update(tuple(batch) if rng.random() < 0.5 else iter(batch))
            ref.update(batch)
        elif op < 0.85:
            batch = [_keys(rng, pool) for _ in range(rng.randint(0, 80))]
            mine.difference_update(batch if rng.random() < 0.5 else iter(batch))
            ref.difference_update(batch)
        elif op < 0.95:
            batch = rng.sample(sorted(ref), min(len(ref), rng.randint(0, 70))) if ref else []
            if rng.random() < 0.5:
                batch.insert(rng.randint(0, len(batch)), _keys(rng, pool))
            assert mine.issuperset(batch) == ref.issuperset(batch)
        elif op < 0.999:
            assert (k in mine) == (k in ref)
        else:
            mine.clear()
            ref.clear()
        if step % 997 == 0:
            assert len(mine) == len(ref)
            assert sorted(mine) == sorted(ref)
            assert all(h in mine for h in ref)
            assert mine.capacity >= 2 * (len(ref) - (0 in ref))  # a load of at most 1/2
    assert sorted(mine) == sorted(ref) and len(mine) == len(ref) and bool(mine) == bool(ref)


def test_a_million_hashes_in_a_huge_page_table_and_out_again(c_speedups):
    # Past 2 MiB the table is mapped (with huge-page advice) instead of calloc'd, and freed likewise.
    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(1 << 20)]
    s = c_speedups.BlockSet()
    s.update(keys)
    assert len(s) == len(set(keys)) and s.capacity >= 2 << 20
    missing = next(k for k in iter(lambda: rng.getrandbits(64), None) if k not in set(keys))
    assert s.issuperset(keys[::7]) and not s.issuperset([*keys[:5], missing])
    s.difference_update(keys[::2])
    left = set(keys) - set(keys[::2])
    assert len(s) == len(left) and sorted(s) == sorted(left)
    s.reserve(4 << 20)  # grows (a rehash into a larger table) with every hash kept
    assert s.capacity >= 8 << 20 and sorted(s) == sorted(left) and s.issuperset(left)


def test_what_is_not_a_block_hash(c_speedups):
    s = c_speedups.BlockSet()
    for bad in (-1, 2**64, 2**200, 1.0, "1", None, b"\x01"):
        with pytest.raises(ValueError, match=r"a block hash is an int in \[0, 2\*\*64\)"):
            s.add(bad)
        with pytest.raises(ValueError):
            s.update([bad])
        assert bad not in s
        s.discard(bad)  # never a member: nothing to drop
        s.difference_update([bad])
        assert not s.issuperset([bad])
        with pytest.raises(KeyError):
            s.remove(bad)
    with pytest.raises(TypeError):
        s.update(5)  # not an iterable
    with pytest.raises(ValueError, match="reserve"):
        s.reserve(-1)
    with pytest.raises(ValueError, match="reserve"):
        c_speedups.BlockSet(reserve=-1)
    s.add(True)  # an int: the key 1, as in a Python set ({True} == {1})
    assert 1 in s and len(s) == 1 and list(s) == [1]
