"""The block pool's two hash maps answer alike: the dict (any hashes) and numpy pages (chain ids)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.emulated.hash_map import ChainIdMap, HashMap
from gpuhit.errors import ConfigError

# chain ids near page boundaries (4096) and far apart, so batches span one page or several; and on
# more pages than the map's first rows, so rows run out, are swept back and the store grows
IDS = st.one_of(st.integers(0, 40), st.integers(4090, 4100), st.integers(1 << 20, (1 << 20) + 5000),
                st.builds(lambda p, o: p * 4096 + o, st.integers(2, 40), st.integers(0, 2)))

OPS = st.lists(st.one_of(
    st.tuples(st.just("cache"), st.lists(IDS, min_size=1, max_size=12)),
    st.tuples(st.just("evict"), st.integers(0, 30)),
    st.tuples(st.just("one"), IDS),
), max_size=40)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(OPS)
def test_chain_id_map_answers_as_the_dict(ops):
    ref, fast = HashMap(), ChainIdMap()
    next_block = 0
    for op, arg in ops:
        if op == "cache":  # setdefault a batch (duplicates allowed: the first cached one stays)
            blocks = list(range(next_block, next_block + len(arg)))
            next_block += len(arg)
            ids = np.array(blocks)
            got_fast = fast.setdefault_all(fast.keys(tuple(arg)), ids)
            got_ref = ref.setdefault_all(ref.keys(tuple(arg)), ids)
            assert (got_fast is None) == (got_ref is None)  # None: every hash was new
            assert got_fast is None or got_fast.tolist() == got_ref.tolist()
        elif op == "evict" and len(ref):  # remove present hashes, in insertion order from some point
            keys = list(ref)[arg % len(ref):][:7]
            ref.pop_all(ref.keys(tuple(keys)))
            fast.pop_all(fast.keys(tuple(keys)))
        elif op == "one":
            assert (arg in fast) == (arg in ref) and fast.get(arg) == ref.get(arg)
        assert len(fast) == len(ref) and set(fast) == set(ref)
        probe = tuple(list(ref)[:9])
        got, want = fast.get_all(probe), ref.get_all(probe)
        assert np.array_equal(got, want)
        assert fast.get_all(probe + (99_999_999,)) is None and ref.get_all(probe + (99_999_999,)) is None
    assert fast.pages() >= {h >> 12 for h in ref}  # emptied pages keep their rows until a sweep
    fast._sweep()
    assert fast.pages() == {h >> 12 for h in ref}  # and a sweep gives them back


def test_scalar_operations_and_bad_hashes():
    m = ChainIdMap()
    m[5] = 1
    assert m.setdefault(5, 2) == 1 and m.setdefault(4096, 3) == 3 and m[4096] == 3
    del m[5]
    assert 5 not in m and m.pop(4096) == 3 and len(m) == 0
    m._sweep()
    assert not m.pages()
    with pytest.raises(KeyError):
        del m[5]
    with pytest.raises(ConfigError, match="not chain ids"):
        m.keys(((1 << 63) + 5,))
    with pytest.raises(ConfigError, match="not chain ids"):
        m.keys((-1,))


def test_rows_grow_and_are_given_back():
    """Ids spread over more pages than the first rows: the store grows (row views remade); pages
    whose last id went, in batches or one by one, give their rows back at the next sweep (when
    the rows run out), and those rows are reused."""
    ref, fast = HashMap(), ChainIdMap()
    keys = np.array([p * 4096 + o for p in range(0, 400, 7) for o in (0, 5, 4095)], np.int64)
    blocks = np.arange(len(keys))
    assert fast.setdefault_all(keys, blocks) is None and ref.setdefault_all(ref.keys(keys.tolist()), blocks) is None
    assert fast.get_all(keys.tolist()).tolist() == blocks.tolist() and len(fast) == len(ref) == len(keys)
    assert fast.get(7 * 4096 + 5) == 4 and 7 * 4096 + 6 not in fast
    fast.pop_all(keys[: len(keys) // 2])
    for h in keys[len(keys) // 2 :].tolist():
        assert fast.pop(h) == ref[h]
    assert len(fast) == 0 and len(fast.pages()) == 400 // 7 + 1  # no sweep yet: the rows are kept
    rows = len(fast._page_of)
    fast._sweep()
    assert not fast.pages() and len(fast._free) == rows
    fast[3] = 9  # a freed row is reused
    assert fast[3] == 9 and list(fast) == [3] and len(fast._page_of) == rows
    fast.setdefault_all(keys + 5 * 4096, blocks)  # more pages than free rows: a sweep, then growth
    assert len(fast) == len(keys) + 1 and fast.get_all((keys + 5 * 4096).tolist()).tolist() == blocks.tolist()
    assert fast[3] == 9
