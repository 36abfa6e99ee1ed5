"""trace_stats on the bundled traces (published shapes) and on a handmade trace (exact counts)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayer.loaders import bundled_path, load_trace
from replayer.stats import _common_prefix, trace_stats
from replayer.trace import Session, Trace, Turn


def test_mooncake_published_shape():
    st = trace_stats(load_trace(bundled_path("mooncake")).trace)
    assert st.requests == 12031
    assert st.span_s == pytest.approx(3536.999)
    assert (st.sessions, st.multi_turn_sessions) == (8057, 2012)
    assert st.input_tokens.mean == pytest.approx(12035.06, abs=0.01)  # README: input mean 12,035
    assert st.total_input_tokens == 144793823
    assert st.input_blocks == 288500
    # README: 36.6% of blocks reused (31.4% within inferred sessions)
    assert st.reuse_intra_session + st.reuse_cross_session == pytest.approx(0.366, abs=0.001)
    assert st.reuse_intra_session == pytest.approx(0.3155, abs=0.001)


def test_weka_bundled_slice():
    st = trace_stats(load_trace(bundled_path("weka")).trace)
    assert (st.sessions, st.root_sessions, st.child_sessions, st.requests) == (39, 20, 19, 2357)
    assert st.turns_per_session.max == 439 and st.turns_per_session.p50 == 21
    assert st.input_tokens.max == 243868
    assert st.reuse_intra_session == pytest.approx(0.961, abs=0.001)
    assert st.reuse_cross_session < 0.002
    d = st.to_dict()
    assert d["turns_per_session"]["max"] == 439 and d["requests"] == 2357


def test_exact_counts_on_handmade_trace():
    a = Session("a", (Turn(48, 1, (1, 2, 3)), Turn(64, 1, (1, 2, 3, 4), offset=5.0)), 16, "g", arrival=0.0)
    b = Session("b", (Turn(32, 1, (1, 9)),), 16, "g", arrival=2.0)
    c = Session("c", (Turn(16, 1, (1,)),), 16, "other", arrival=1.0, parent="a")
    st = trace_stats(Trace("t", "native", (a, b, c), "global"))
    # send order: a0 (t=0: 1,2,3 new), c0 (t=1: ns other, 1 new), b0 (t=2: 1 cross, 9 new), a1 (t=5: 1,2,3 intra, 4 new)
    assert st.input_blocks == 10
    assert (st.reuse_intra_session, st.reuse_cross_session, st.new_blocks) == (0.3, 0.1, 0.6)
    assert (st.sessions, st.root_sessions, st.child_sessions, st.requests, st.span_s) == (3, 2, 1, 4, 5.0)
    assert (st.multi_turn_sessions, st.multi_turn_request_share) == (1, 0.5)
    assert st.turns_per_session.max == 2 and st.output_tokens.mean == 1.0


def test_no_hash_ids_reports_no_reuse():
    st = trace_stats(load_trace(bundled_path("azure")).trace)
    assert (st.input_blocks, st.reuse_intra_session, st.new_blocks, st.requests) == (0, 0.0, 0.0, 200)


def _naive_reuse(trace: Trace) -> tuple[int, int, int]:
    reqs = sorted(
        (
            (s.arrival + t.offset, n, i, t)
            for n, (i, s, t) in enumerate((i, s, t) for i, s in enumerate(trace.sessions) for t in s.turns)
        ),
        key=lambda r: (r[0], r[1]),
    )
    seen_ns, seen_sess = set(), set()
    intra = cross = total = 0
    for _, _, i, t in reqs:
        ns = trace.sessions[i].namespace
        for h in t.hash_ids:
            total += 1
            if (i, h) in seen_sess:
                intra += 1
            elif (ns, h) in seen_ns:
                cross += 1
            seen_sess.add((i, h))
            seen_ns.add((ns, h))
    return intra, cross, total


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.lists(
                st.tuples(st.lists(st.integers(0, 12), max_size=8), st.integers(0, 5)), min_size=1, max_size=4
            ),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_reuse_counts_match_a_naive_reference(spec):
    sessions = tuple(
        Session(
            f"s{n}",
            tuple(Turn(16 * len(ids), 1, tuple(ids), offset=float(off)) for ids, off in turns),
            16,
            ns,
        )
        for n, (ns, turns) in enumerate(spec)
    )
    trace = Trace("t", "native", sessions, "global")
    intra, cross, total = _naive_reuse(trace)
    st_ = trace_stats(trace)
    assert st_.input_blocks == total
    if total:
        assert (round(st_.reuse_intra_session * total), round(st_.reuse_cross_session * total)) == (
            intra,
            cross,
        )


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert _common_prefix(tuple(a), tuple(b)) == n
