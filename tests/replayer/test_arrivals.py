import numpy as np
import pytest

from gpuhit.errors import ConfigError
from replayer.arrivals import ArrivalConfig, child_offset, children_index, root_start_times, roots
from replayer.trace import Session, Trace, Turn

T = (Turn(10, 1, (1,)),)


def s(sid, arrival=0.0, parent=None):
    return Session(sid, T, 64, sid, arrival=arrival, parent=parent)


def test_roots_ordered_by_arrival_then_position():
    tr = Trace("t", "native", (s("b", 5.0), s("a", 1.0), s("c", 1.0), s("k", 2.0, parent="a")))
    assert [x.session_id for x in roots(tr)] == ["a", "c", "b"]
    assert [x.session_id for x in children_index(tr)["a"]] == ["k"]


def test_trace_mode_is_relative_and_scaled():
    rs = [s("a", 10.0), s("b", 12.0), s("c", 20.0)]
    assert root_start_times(rs, ArrivalConfig("trace", time_scale=0.5)) == [0.0, 1.0, 5.0]


def test_poisson_is_seeded_with_first_at_zero():
    rs = [s(f"x{i}") for i in range(1000)]
    a = root_start_times(rs, ArrivalConfig("poisson", session_rate=2.0, seed=1))
    b = root_start_times(rs, ArrivalConfig("poisson", session_rate=2.0, seed=1))
    assert a == b and a[0] == 0.0
    gaps = np.diff(a)
    assert (gaps >= 0).all()
    assert abs(gaps.mean() - 0.5) < 0.05  # rate 2/s
    assert root_start_times(rs, ArrivalConfig("concurrent", sessions_concurrent=3)) is None


def test_child_offset_scaled_and_clamped():
    p = s("p", 10.0)
    assert child_offset(s("c", 13.0, "p"), p, 2.0) == 6.0
    assert child_offset(s("c", 9.0, "p"), p, 1.0) == 0.0


def test_unknown_parent_is_an_error():
    with pytest.raises(ConfigError, match="unknown parent"):
        children_index(Trace("t", "native", (s("c", parent="nope"),)))
