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


def test_simulated_engines_of_a_profile_with_the_table_slow_each_other_only_while_both_work():
    """Through the simulator (``modeled_level``: round-robin over two emulated engines, virtual time):
    the fitted CPU profile with a factor of 1.5 for two busy engines, against the same without it."""
    import dataclasses
    import math

    from engines.emulated.profile import load_profile
    from replayer.calibrate_path import modeled_level

    plain = load_profile("analysis/results/live-path-2026-11-27.profile.json")
    shared = dataclasses.replace(plain, host_contention=(1.0, 1.5))
    kw = {"num_gpu_blocks": 256, "max_model_len": 2048}

    def ttft(prof, sent):
        level = {"concurrency": 2, "output_tokens": 16, "requests": [[t, math.nan, math.nan, 1500, 0] for t in sent]}
        return modeled_level(level, prof, 2, kw, 0.0)["engine_ttft_model_s"]

    front = plain.frontend_delay(1500)  # the API server's part of the TTFT: not a step, never scaled
    assert ttft(shared, [0.0]) == ttft(plain, [0.0])  # one engine busy: its steps as without the table
    assert ttft(shared, [0.0, 30.0]) == ttft(plain, [0.0, 30.0])  # one after the other
    # one request on each engine at once: every prefill step of both under the two-engine factor
    assert ttft(shared, [0.0, 0.0]) - front == pytest.approx(1.5 * (ttft(plain, [0.0, 0.0]) - front))
