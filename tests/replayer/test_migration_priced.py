"""``lpwl_auto`` with ``migrate: priced`` in a simulated replay: the policy's MIGRATE decisions run
through the router's two-step KV move (producer step on the holder, import on the target), and the
moved turns find the prefix the policy priced them with.

The first sessions of the bundled WEKA slice on three instances whose KV pools hold about two of
their contexts each (the regime where ``lpwl_auto`` moves sessions off an overflowing holder).
"""

from __future__ import annotations

from replayer.loaders import bundled_path, load_trace
from replayer.simulate import simulate


def _run(migrate: str):
    trace = load_trace(bundled_path("weka")).trace
    policy = {"name": "m", "type": "lpwl_auto", "params": {"migrate": migrate}}
    return simulate(trace, policy, instances=3, arrival="poisson", session_rate=0.05, max_think_time=30, seed=3,
                    progress=False, max_sessions=5, block_size=64,
                    engine_kwargs={"kv_capacity_bytes": 14e9, "max_model_len": 131_072, "block_size": 64})


def test_priced_migration_moves_kv_and_the_moved_turns_hit_it():
    res = _run("priced")
    moved = [r for r in res.records if r.action == "migrate"]
    assert moved and res.router_stats["migrations"] == len(moved)
    assert all(r.ok for r in moved)
    # the target imported the holder's prefix: most moved turns realize the whole predicted hit
    # (a moved context can still be evicted on the target before the turn runs)
    full = [r for r in moved if r.realized_hit_tokens >= r.predicted_hit_tokens]
    assert len(full) >= 0.75 * len(moved)
    assert not [r for r in _run("none").records if r.action == "migrate"]
