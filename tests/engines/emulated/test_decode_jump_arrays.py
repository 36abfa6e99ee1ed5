"""The decode jump's array forms against the step-by-step definitions they replace: the step ends
(bit-identical floats), the allocation plan (vLLM's order) and the histogram of step gaps."""

from __future__ import annotations

import bisect
import itertools
import random

import numpy as np
import pytest

from engines.emulated.decode_jump import Allocations
from engines.emulated.metrics import ITL_BUCKETS, Histogram
from engines.emulated.profile import load_profile


@pytest.mark.parametrize("seed", range(20))
def test_step_ends_equal_summing_step_time(seed):
    rng = random.Random(seed)
    prof = load_profile("qwen3-coder-30b-a3b@h20")
    start = rng.uniform(0, 1e5)
    n, ctx, k = rng.randint(1, 256), rng.randint(0, 10**7), rng.randint(1, 3000)
    t, ref = start, []
    for j in range(k):
        t = t + prof.step_time(n, 0.0, ctx + n * j)
        ref.append(t)
    assert np.asarray(prof.decode_step_ends(start, n, ctx, k)).tolist() == ref  # exact, float for float (short: the sum itself)


@pytest.mark.parametrize("seed", range(20))
def test_allocations_follow_vllms_order(seed):
    rng = random.Random(seed)
    bs = rng.choice((1, 2, 16, 64))
    computed = [rng.randint(1, 5000) for _ in range(rng.randint(1, 40))]
    k = rng.randint(0, 300)
    ref = []  # (step, running index) of every block a decode starts in steps 2..k
    if k >= 2:
        for idx, c in enumerate(computed):
            j0 = 1 + ((-c) % bs)
            if j0 == 1:
                j0 += bs
            ref.extend((j, idx) for j in range(j0, k + 1, bs))
        ref.sort()
    a = Allocations.of_stretch(computed, bs, k)
    assert list(zip(a.step.tolist(), a.owner.tolist())) == ref
    for j in range(k + 2):
        assert a.upto(j) == sum(1 for s, _ in ref if s <= j)


def test_observe_array_buckets_like_observe():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.exponential(0.3, 500), np.array(ITL_BUCKETS)])  # edges: le is inclusive
    one, arr = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
    for v in values.tolist():
        one.observe(v, 3)
    arr.observe_array(values, 3)
    assert arr.counts == one.counts and arr.count == one.count
    assert arr.sum == pytest.approx(one.sum)
    assert one.counts[bisect.bisect_left(ITL_BUCKETS, 0.01)] >= 3


@pytest.mark.parametrize("n", [2, 30, 200])
def test_observe_gaps_buckets_like_observe(n):
    times = np.cumsum(np.random.default_rng(n).exponential(0.05, n)).tolist()
    one, gaps = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
    for a, b in itertools.pairwise(times):
        one.observe(b - a, 4)
    gaps.observe_gaps(times, 4)
    assert gaps.counts == one.counts and gaps.count == one.count and gaps.sum == pytest.approx(one.sum)
