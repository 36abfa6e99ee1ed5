"""replayer.trace_scale: a trace cut down to a small context keeps its reuse and think times."""

from __future__ import annotations

import pytest

from gpuhit.errors import ConfigError
from replayer.loaders import bundled_path, load_trace
from replayer.trace_scale import scale_to_context


def test_scaled_prompts_fit_and_still_extend_each_other():
    trace = load_trace(bundled_path("weka")).trace
    scaled = scale_to_context(trace, 1800, max_output=16, max_turns=5)
    assert len(scaled.sessions) == len(trace.sessions)
    for s0, s in zip(trace.sessions, scaled.sessions):
        assert len(s.turns) == min(5, len(s0.turns))
        for prev, (t0, t) in zip((None, *s.turns), zip(s0.turns, s.turns)):
            assert 1 <= t.input_length <= 1800 and 1 <= t.output_length <= 16
            assert t.think_time == t0.think_time  # the closed loop's gaps are kept
            if prev is not None and t0.hash_ids[: len(prev.hash_ids)] == s0.turns[s.turns.index(prev)].hash_ids:
                assert t.hash_ids[: len(prev.hash_ids)] == prev.hash_ids


def test_bad_limits_are_refused():
    trace = load_trace(bundled_path("weka")).trace
    with pytest.raises(ConfigError):
        scale_to_context(trace, 0)
    with pytest.raises(ConfigError):
        scale_to_context(trace, 100, max_output=0)
