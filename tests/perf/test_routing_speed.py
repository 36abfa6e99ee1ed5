"""Routing-decision time: snapshot + index match + policy, for 8 and 64 instances, 6,500-block prompts.

Prints microseconds per decision (p50 / p99) per policy; run with `make bench`
(pytest -s tests/perf/test_routing_speed.py).
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from engines.fake import FakeEngine
from engines.kv_events import BlockStored, KVEventBatch
from gateway.kv_index import PreciseKVIndex
from gateway.router import Router, RouteRequest
from policies import registry

BLOCKS = 6500
BS = 16
POLICIES = [
    "round_robin", "least_request", "lmetric", "linear", {"type": "linear", "params": {"variant": "dynamo"}},
    "sticky", "unified", "lpwl", "lpwl_migrate", "route_query", {"type": "pd_disagg", "params": {"num_prefill": 2}},
]


def build_index(n: int, rng: random.Random) -> tuple[PreciseKVIndex, list[FakeEngine], list[tuple[int, ...]]]:
    engines = [FakeEngine(f"e{i}", capacity_blocks=40_000) for i in range(n)]
    idx = PreciseKVIndex(n)
    chains = [tuple(rng.getrandbits(63) for _ in range(BLOCKS + 20)) for _ in range(4)]
    for i in range(n):
        own = tuple(rng.getrandbits(63) for _ in range(BLOCKS))
        idx.on_kv_event(i, KVEventBatch(0.0, (BlockStored(own, None, (), BS),)))
        # Instance i holds a prefix of each shared chain of a different length (some none, some all).
        for c, chain in enumerate(chains):
            k = (BLOCKS * ((i + c) % (n + 1))) // n
            if k:
                idx.on_kv_event(i, KVEventBatch(0.0, (BlockStored(chain[:k], None, (), BS),)))
    return idx, engines, chains


@pytest.mark.parametrize("n", [8, 64])
def test_routing_decision_speed(n):
    rng = random.Random(n)
    idx, engines, chains = build_index(n, rng)
    print(f"\n{n} instances, {BLOCKS}-block prompts: us/decision (snapshot + match + policy)")
    print(f"  {'policy':<16} {'p50':>8} {'p99':>8}   {'match p50':>9}")
    for cfg in POLICIES:
        policy = registry.build(cfg)
        router = Router(engines, policy, index=idx, clock=lambda: 0.0)
        for i in range(n):  # some load so the load terms are non-trivial
            router._in_flight[i] = i % 5
            router._pending[i] = 1000 * (i % 7)
        reqs = [
            RouteRequest(f"r{k}", (BLOCKS + 20) * BS, 64, chains[k % 4], session_id=f"s{k % 50}")
            for k in range(400)
        ]
        times, mtimes = [], []
        for r in reqs:
            t0 = time.perf_counter()
            router.decide(r)
            t1 = time.perf_counter()
            idx.match(r.block_hashes)
            t2 = time.perf_counter()
            times.append((t1 - t0) * 1e6)
            mtimes.append((t2 - t1) * 1e6)
        times.sort()
        name = cfg if isinstance(cfg, str) else f"{cfg['type']}/{next(iter(cfg['params'].values()))}"
        p99 = times[int(0.99 * (len(times) - 1))]
        print(f"  {name:<16} {statistics.median(times):8.1f} {p99:8.1f}   {statistics.median(mtimes):9.1f}")
