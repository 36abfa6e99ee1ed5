"""replayer/replicas.py: K simulated gateway replicas, unshared and sharing decisions."""

from __future__ import annotations

import pytest

from engines.fake import FakeEngine
from gpuhit.errors import ConfigError
from replayer.cli import main
from replayer.replicas import ReplicaConfig, ReplicaSet
from replayer.simulate import simulate
from replayer.trace import Session, Trace, Turn


def fake(name, i, registry):
    return FakeEngine(name, prefill_s_per_token=1e-4, decode_s_per_token=1e-2)


def on_two_replicas(ids, seed=0):
    """Two session ids among ``ids`` that the sticky balancer puts on replicas 0 and 1 (in that order)."""
    rs = ReplicaSet([None, None], ReplicaConfig(2), seed)
    by = {}
    for s in ids:
        by.setdefault(rs.replica_of(s), s)
    return by[0], by[1]


A, B = on_two_replicas([f"s{i}" for i in range(20)])
# Two cold sessions at the same moment, then each session's second turn.
TRACE = Trace("t", "native", (
    Session(A, (Turn(640, 4, tuple(range(1, 41))), Turn(704, 4, tuple(range(1, 45)), think_time=1.0)), 16, A),
    Session(B, (Turn(640, 4, tuple(range(100, 140))), Turn(704, 4, tuple(range(100, 144)), think_time=1.0)), 16, B),
))


def run(cfg=None, policy="lpwl", **kw):
    r = simulate(TRACE, policy, instances=2, engine_factory=fake, progress=False, replicas=cfg,
                 arrival="concurrent", sessions_concurrent=2, **kw)
    return r, sorted((x.session, x.turn, x.instance) for x in r.records)


def test_unshared_replicas_pile_onto_one_instance_and_sharing_spreads_them():
    def where(rows):
        return {s: {i for s2, _, i in rows if s2 == s} for s in (A, B)}

    _, one = run()
    # one router: the second cold session goes to the other, idle instance; each session stays
    assert where(one)[A] | where(one)[B] == {"gpu0", "gpu1"} and all(len(v) == 1 for v in where(one).values())
    r, two = run(ReplicaConfig(2))
    # each replica saw an idle cluster: both cold sessions went to the same instance, and stayed by their KV
    assert where(two)[A] == where(two)[B] and len(where(two)[A]) == 1
    assert r.router_stats["requests_by_replica"] == [2, 2] and r.router_stats["decisions"] == 4
    r, shared = run(ReplicaConfig(2, share="decisions"))
    assert shared == one
    assert r.router_stats["share_messages"] > 0
    # a propagation delay longer than the gap between the two decisions: as if unshared
    _, late = run(ReplicaConfig(2, share="decisions", share_delay=0.5))
    assert late == two


def test_random_balancer_scatters_a_session_and_sharing_keeps_its_binding():
    for seed in range(4):
        r, rows = run(ReplicaConfig(4, lb="random", share="decisions"), policy="sticky", seed=seed)
        assert sum(r.router_stats["requests_by_replica"]) == 4
        # whichever replica a turn reached, it knew the session's binding (made by another replica)
        assert {(s, i) for s, _, i in rows} == {(s, i) for s, t, i in rows if t == 0}


def test_fully_shared_replicas_decide_as_one_router_on_the_bundled_slice():
    from replayer.loaders import bundled_path, load_trace

    tr = load_trace([bundled_path("weka")]).trace
    kw = {"instances": 4, "progress": False, "max_sessions": 6, "max_requests": 60, "arrival": "poisson",
          "session_rate": 0.05}
    one = simulate(tr, "lpwl", **kw)
    shared = simulate(tr, "lpwl", replicas=ReplicaConfig(2, share="decisions"), **kw)
    assert [(x.session, x.turn, x.instance, x.finish) for x in shared.records] == \
        [(x.session, x.turn, x.instance, x.finish) for x in one.records]
    assert sum(shared.router_stats["requests_by_replica"]) == 60
    assert min(shared.router_stats["requests_by_replica"]) > 0  # both replicas routed


def test_one_replica_records_are_byte_identical_to_a_plain_replay(tmp_path):
    base = ["replay", "--policies", "lpwl", "--seeds", "0", "--max-sessions", "1", "--max-requests", "15",
            "--no-plots", "--json", "--jobs", "1"]
    assert main(base + ["--out", str(tmp_path / "plain")]) == 0
    assert main(base + ["--gateway-replicas", "1", "--share", "decisions", "--out", str(tmp_path / "k1")]) == 0
    assert main(base + ["--gateway-replicas", "2", "--out", str(tmp_path / "k2")]) == 0
    plain = (tmp_path / "plain" / "records" / "lpwl-seed0.csv").read_bytes()
    assert (tmp_path / "k1" / "records" / "lpwl-seed0.csv").read_bytes() == plain
    assert (tmp_path / "k2" / "records" / "lpwl-seed0.csv").exists()


def test_bad_replica_options_are_clear_errors():
    with pytest.raises(ConfigError, match="--gateway-replicas"):
        ReplicaConfig(0)
    with pytest.raises(ConfigError, match="--share"):
        ReplicaConfig(2, share="gossip")
    with pytest.raises(ConfigError, match="--replica-lb"):
        ReplicaConfig(2, lb="hash")
    with pytest.raises(ConfigError, match="--share-delay"):
        ReplicaConfig(2, share="decisions", share_delay=-1)
    assert main(["replay", "--gateway-replicas", "2", "--gateway", "http://127.0.0.1:9"]) == 2
    assert ReplicaConfig(4, share="decisions", share_delay=0.01, lb="random").label == "x4-random-share@0.01s"


def test_sweep_replicas_axis_and_preset():
    import argparse

    from replayer.cli_sweep import PRESETS
    from replayer.sweep_grid import grid

    ns = argparse.Namespace(rates="0.008", kv_gib=None, zipf=None, replicas="1,4")
    pts = grid(ns)
    assert [p.name for p in pts] == ["rate0.008_replicas1", "rate0.008_replicas4"]
    assert pts[1].axes() == {"rate": 0.008, "kv_gib": None, "zipf": None, "replicas": 4}
    assert PRESETS["replicas"]["replicas"] == "1,2,4,8"
    with pytest.raises(ConfigError, match="whole numbers"):
        grid(argparse.Namespace(rates=None, kv_gib=None, zipf=None, replicas="1.5"))
