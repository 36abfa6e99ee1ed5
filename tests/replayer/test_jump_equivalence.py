"""Decode jumps are a speed device only: a whole simulated replay (router, KV index, policies,
closed-loop driver) must produce the same records with them as with step-by-step engines.

This is the end-to-end guard for three pieces that make it so: the jump past a blocked waiting
head (``EmulatedEngine._blocked_plan``), the router flushing a jump's due KV events before it
reads the index (``EmulatedEngine.flush_kv_events``), and the virtual-time loop's FIFO order for
timers due at the same instant (without it, equal deadlines pop in an order that depends on how
many other timers are pending, which jumping changes).
"""

from __future__ import annotations

import pytest

from replayer.loaders import bundled_path, load_trace
from replayer.simulate import emulated_factory, simulate


def _run(trace, policy, jump: bool, roles=None):
    engines = []
    # max_model_len 30,000 fits 3 GB of KV (vLLM refuses to start with a longer one)
    base = emulated_factory("qwen3-coder-30b-a3b@h20", {"jump_decode": jump, "kv_capacity_bytes": 3e9,
                                                          "max_model_len": 30_000})

    def factory(name, i, registry):
        e = base(name, i, registry)
        engines.append(e)
        return e

    r = simulate(trace, policy, instances=len(roles) if roles else 3, roles=roles, arrival="poisson",
                 session_rate=0.05, max_think_time=30, seed=3, progress=False, engine_factory=factory,
                 max_sessions=6)
    rows = [(x.instance, x.action, x.arrival, x.first_token, x.finish, x.input_tokens, x.output_tokens,
             x.predicted_hit_tokens, x.realized_hit_tokens, x.error) for x in r.records]
    jumps = sum(e.num_jumps for e in engines)
    return rows, jumps


@pytest.fixture(scope="module")
def trace():
    return load_trace(bundled_path("weka")).trace


@pytest.mark.parametrize(("policy", "roles"), [
    ("lpwl", None),
    ("lpwl_migrate", None),
    ("pd_disagg", ("prefill", "decode", "decode")),
])
def test_replay_with_decode_jumps_equals_stepping(trace, policy, roles):
    jumped, n_jumps = _run(trace, policy, True, roles)
    stepped, n_none = _run(trace, policy, False, roles)
    assert n_jumps > 0 and n_none == 0
    assert len(jumped) > 50
    assert jumped == stepped
