"""The shared-host probe's reduction (``replayer.calibrate_host``): raw levels -> host_contention factors.
The probe itself runs on the real vLLM pair (``tests/e2e/test_real_vllm_liveab.py``)."""

import pytest

from gpuhit.errors import ConfigError, EngineError
from replayer.calibrate_host import busy_sets, host_contention_from


def _level(busy, per_engine):
    """A level whose engine i took ``per_engine[i]`` = (prefill s, decode s) per request over 4 requests."""
    return {"busy": busy, "requests": 4, "engine": {
        str(i): {"prefill": [4 * per_engine[i][0], 4], "decode": [4 * per_engine[i][1], 4], "queue": [0.0, 4]}
        for i in busy}}


def test_busy_sets_are_each_engine_alone_then_the_first_k_together():
    assert busy_sets(2) == [[0], [1], [0, 1]]
    assert busy_sets(3) == [[0], [1], [2], [0, 1], [0, 1, 2]]


def test_the_factor_is_the_busy_engines_time_over_the_same_engines_alone():
    alone = {0: (0.2, 0.1), 1: (0.3, 0.1), 2: (0.25, 0.05)}
    levels = [_level([i], alone) for i in range(3)]
    levels.append(_level([0, 1], {0: (0.3, 0.2), 1: (0.4, 0.2)}))
    levels.append(_level([0, 1, 2], {0: (0.4, 0.2), 1: (0.5, 0.3), 2: (0.4, 0.2)}))
    factors, rows = host_contention_from(levels)
    assert factors == pytest.approx([1.0, 1.1 / 0.7, 2.0 / 1.0])
    assert [r["busy_engines"] for r in rows] == [2, 3]
    assert rows[0]["prefill_factor"] == pytest.approx(0.7 / 0.5) and rows[0]["decode_factor"] == pytest.approx(2.0)
    assert host_contention_from(levels[::-1])[0] == factors  # order of the levels does not matter


def test_incomplete_levels_are_refused():
    alone = {0: (0.2, 0.1), 1: (0.3, 0.1)}
    with pytest.raises(ConfigError, match="first k together"):
        host_contention_from([_level([0], alone), _level([1], alone)])
    with pytest.raises(ConfigError, match="lack engines"):
        host_contention_from([_level([0], alone), _level([0, 1], alone)])
    broken = _level([0, 1], alone)
    broken["engine"]["1"]["decode"][1] = 3  # a request the engine's decode histogram did not count
    with pytest.raises(EngineError, match="counted"):
        host_contention_from([_level([0], alone), _level([1], alone), broken])
