"""Simulated records with the engine's own timing: the same records, plus columns that add up."""

import dataclasses

import numpy as np

from replayer.loaders import bundled_path, load_trace
from replayer.records import COLUMNS, EngineTimedRecord
from replayer.simulate import simulate


def _run(engine_timing):
    # the pinned runs' setting: requests queue, blocks are evicted, a request is preempted
    return simulate(load_trace(bundled_path("weka")).trace, "lpwl", instances=2, arrival="poisson", session_rate=0.5,
                    max_think_time=5, seed=1, progress=False, max_sessions=5, engine_timing=engine_timing,
                    engine_kwargs={"kv_capacity_bytes": 14e9, "max_model_len": 131_072})


def test_engine_timing_adds_columns_and_changes_nothing_else():
    plain, timed = _run(False), _run(True)
    assert all(type(r) is EngineTimedRecord for r in timed.records)
    assert [dataclasses.astuple(r) for r in plain.records] == [
        tuple(getattr(r, c) for c in COLUMNS) for r in timed.records]
    ok = [r for r in timed.records if r.ok]
    assert len(ok) > 400 and any(r.engine_queue > 0 for r in ok) and any(r.preemptions for r in ok)
    for r in ok:
        assert r.engine_missing == "" and r.trace_id == ""
        parts = np.array([r.engine_queue, r.engine_prefill, r.engine_decode])
        assert (parts >= 0).all()
        # the emulator's frontend delay is the rest of its e2e; the engine's interval lies in the client's
        assert parts.sum() <= r.engine_e2e + 1e-9
        assert r.arrival - 1e-9 <= r.engine_arrival and r.engine_arrival + r.engine_e2e <= r.finish + 1e-9
        assert r.engine_ttft == r.first_token - r.engine_arrival
