"""The live path under load, from recorded probe timings to the simulator's model: how one level of
``measure_path_loaded`` (a closed loop of cold prompts through a gateway) reduces to a row of
``fit.live_path.by_in_flight``, and that row to :class:`replayer.live_path.LivePathModel`."""

from __future__ import annotations

import math

import pytest

from gpuhit.errors import EngineError
from replayer.calibrate_path import loaded_path_row
from replayer.live_path import from_fit

# Two levels as `gpuhit profile fit --path-in-flight 0,2 --path-requests 4 --path-output-tokens 4` recorded
# them on the tests' real vLLM pair (fit.measurements.path_load): per request [sent, first token, finish]
# in s from the level's start, its prompt tokens and the cached ones; the engines' histogram deltas
# [sum, count] over the level.
ONE_CLIENT = {"concurrency": 1, "output_tokens": 4, "requests": [
    [8.1843e-05, 0.022618009, 0.022708946, 32, 0], [0.022773602, 0.050479054, 0.050558584, 362, 0],
    [0.050690162, 0.111906457, 0.111996122, 32, 0], [0.112050153, 0.145578273, 0.145663961, 32, 0]],
    "engine": {"ttft": [0.09566617, 4.0], "prefill": [0.087571461, 4.0], "queue": [9.9239e-05, 4.0]}}
THREE_CLIENTS = {"concurrency": 3, "output_tokens": 4, "requests": [
    [7.949e-05, 0.030026229, 0.030105639, 32, 0], [0.000369245, 0.317434423, 0.317520713, 4088, 0],
    [0.006113715, 0.215886929, 0.215975952, 362, 0], [0.030160951, 0.322468596, 0.322507385, 32, 0]],
    "engine": {"ttft": [0.62460041, 4.0], "prefill": [0.590945169, 4.0], "queue": [8.8363e-05, 4.0]}}


def test_one_client_meets_no_other_request_and_its_path_is_client_less_engine_ttft():
    row = loaded_path_row(ONE_CLIENT)
    client = (0.022618009 - 8.1843e-05 + 0.050479054 - 0.022773602 + 0.111906457 - 0.050690162
              + 0.145578273 - 0.112050153) / 4
    assert row["in_flight"] == 0 and row["concurrency"] == 1 and row["n"] == 4
    assert row["client_ttft_s"] == pytest.approx(client)
    assert row["engine_ttft_s"] == pytest.approx(0.09566617 / 4)
    assert row["path_s"] == pytest.approx(client - 0.09566617 / 4)
    assert row["engine_prefill_s"] == pytest.approx(0.087571461 / 4) and row["new_tokens"] == (32 * 3 + 362) / 4
    assert row["tpot_s"] == pytest.approx((0.022708946 - 0.022618009 + 0.050558584 - 0.050479054 + 0.111996122
                                           - 0.111906457 + 0.145663961 - 0.145578273) / 4 / 3)


def test_three_clients_count_the_others_each_request_met_ramp_up_included():
    # arrivals 0.0001 (none in flight), 0.0004 (1), 0.0061 (2), 0.0302 (the first finished at 0.0301: 2)
    assert loaded_path_row(THREE_CLIENTS)["in_flight"] == pytest.approx(5 / 4)


def test_the_rows_give_the_simulators_model_beyond_the_direct_path():
    rows = [loaded_path_row(lv) for lv in (THREE_CLIENTS, ONE_CLIENT)]  # any order
    direct = 0.010
    model = from_fit({"direct_path_s": direct, "gateway_ttft_s": 0.0, "by_in_flight": rows})
    (k0, s0), (k1, s1) = model.points
    assert (k0, k1) == (0.0, 1.25)
    assert s0 == pytest.approx(max(rows[1]["path_s"] - direct, 0.0)) and s1 == pytest.approx(rows[0]["path_s"] - direct)
    assert model(1) == pytest.approx(s0 + (s1 - s0) / 1.25) and model(8) == pytest.approx(s1)  # flat past the last


def test_a_level_the_engines_did_not_fully_count_or_without_timings_is_refused():
    short = {**ONE_CLIENT, "engine": {**ONE_CLIENT["engine"], "ttft": [0.07, 3.0]}}
    with pytest.raises(EngineError, match="counted 3 first tokens for 4"):
        loaded_path_row(short)
    no_first = {**ONE_CLIENT, "requests": [[0.0, math.nan, 0.1, 32, 0]]}
    with pytest.raises(EngineError, match="no complete timings"):
        loaded_path_row(no_first)
    with pytest.raises(EngineError, match="no complete timings"):
        loaded_path_row({**ONE_CLIENT, "requests": []})


class CountingProber:
    """Stands for the gateway's prober: answers after yielding, and notes how many were open at each send."""

    def __init__(self):
        self.open = 0
        self.seen: list[int] = []
        self.sizes: list[int] = []

    def ids(self, n):
        self.sizes.append(n)
        return [1] * n

    async def complete(self, ids, tokens):
        import asyncio

        self.seen.append(self.open)
        self.open += 1
        for _ in range(3):
            await asyncio.sleep(0)
        self.open -= 1
        return 0.001, 0, 0.002


def test_the_closed_loop_keeps_its_clients_busy_and_sends_exactly_the_requests_asked():
    import asyncio
    import random

    from replayer.engine_probe import closed_loop

    via = CountingProber()
    rng = random.Random(0)
    got = asyncio.run(closed_loop(via, 3, (rng.choice([100, 1800]) for _ in range(10)), 4))
    assert len(got) == 10 and set(via.sizes) <= {100, 1800} and sorted(r[3] for r in got) == sorted(via.sizes)
    assert via.seen[:3] == [0, 1, 2] and max(via.seen) == 2  # three clients, never more in flight
    assert all(r[0] <= r[1] <= r[2] for r in got) and [r[0] for r in got] == sorted(r[0] for r in got)


def test_the_step_model_replays_a_level_and_queues_requests_sent_together():
    from engines.emulated.profile import load_profile
    from replayer.calibrate_path import modeled_level

    def modeled_engine_ttft(*a):
        return modeled_level(*a)["engine_ttft_model_s"]

    prof = load_profile("analysis/results/live-path-2026-11-27.profile.json")
    kw = {"num_gpu_blocks": 256, "max_model_len": 2048}

    def level(sent):
        return {"concurrency": 4, "output_tokens": 16,
                "requests": [[t, math.nan, math.nan, 1500, 0] for t in sent]}

    apart = modeled_engine_ttft(level([0.0, 10.0, 20.0, 30.0]), prof, 2, kw, 0.0)
    together = modeled_engine_ttft(level([0.0, 0.0, 0.0, 0.0]), prof, 2, kw, 0.0)
    lone = modeled_engine_ttft(level([0.0]), prof, 2, kw, 0.0)
    assert apart == pytest.approx(lone) and together > 1.2 * lone  # two per engine: the second waits
    # less the direct path the frontend delay holds, as sim-vs-real splits a run's TTFT
    assert modeled_engine_ttft(level([0.0]), prof, 2, kw, 0.004) == pytest.approx(lone - 0.004)
    # a lone request's 15 decode steps after its first token, each a one-sequence step of the profile
    tpot = modeled_level(level([0.0]), prof, 2, kw, 0.0)["tpot_model_s"]
    assert tpot == pytest.approx(prof.step_time(1, 0.0, 1500 + 8), rel=0.05)
