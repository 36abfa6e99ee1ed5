"""Host stalls (``Profile.stalls``, engines.emulated.stalls): drawn per engine from the run's seed, so a
run's records are reproducible; over many steps the added time is the measured mean; a profile
without them, or with none measured, times every step as before."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engines.emulated.profile import load_profile
from engines.emulated.stalls import Stalls
from gpuhit.errors import ConfigError
from replayer.simulate import simulate
from replayer.trace import Session, Trace, Turn

STALLS = Stalls(step_rate_per_s=4.0, step_lengths_s=(0.05, 0.1, 0.3), request_p=0.2, request_lengths_s=(0.02, 0.2),
                path_p=0.1, path_lengths_s=(0.05, 0.25))


def _trace() -> Trace:
    sessions = tuple(Session(f"s{i}", tuple(Turn(600 + 100 * j, 8, tuple(range(i * 100, i * 100 + 10 + 4 * j)))
                                            for j in range(3)), 64, f"s{i}", arrival=0.3 * i) for i in range(12))
    return Trace("stalls", "native", sessions)


def _run(profile, seed: int):
    res = simulate(_trace(), "round_robin", instances=2, profile=profile, arrival="poisson", session_rate=2.0,
                   seed=seed, block_size=64, progress=False, max_think_time=1.0,
                   engine_kwargs={"num_gpu_blocks": 256, "max_model_len": 4096})
    assert all(r.ok for r in res.records)
    return [(r.session, r.turn, r.instance, r.arrival, r.first_token, r.finish) for r in res.records]


@pytest.fixture(scope="module")
def base():
    return load_profile("qwen3-coder-30b-a3b@h20")


def test_the_same_seed_meets_the_same_stalls_and_another_seed_others(base):
    prof = dataclasses.replace(base, stalls=STALLS)
    plain = _run(base, 1)
    a, b, c = _run(prof, 1), _run(prof, 1), _run(prof, 2)
    assert a == b
    assert a != plain and a != c
    # stalls only lengthen: no request finishes earlier than without them, some later
    late = [x[5] - y[5] for x, y in zip(sorted(a), sorted(plain))]
    assert max(late) > 0.05


def test_no_stalls_measured_gives_the_records_of_a_profile_without_them(base):
    assert _run(dataclasses.replace(base, stalls=Stalls()), 3) == _run(base, 3)


def test_over_many_steps_the_added_time_is_the_measured_mean():
    s = STALLS.sampler(7)
    step = 0.02
    n = 200_000
    added = sum(s.step(step) - step for _ in range(n))
    assert added / (n * step) == pytest.approx(STALLS.mean_step_excess(), rel=0.03)
    req = sum(s.request() for _ in range(n)) / n
    assert req == pytest.approx(STALLS.mean_request_excess(), rel=0.03)
    assert STALLS.mean_step_excess() == pytest.approx(4.0 * 0.15)


def test_under_a_host_model_the_mean_step_and_the_mean_path_stay_the_measured_ones():
    """A host model's factor and the live path's lag are means that hold the stalls already: the
    stalls move part of them into a tail, the mean stays; an engine whose host is not oversubscribed
    (factor 1) is not preempted."""
    s = STALLS.sampler(11)
    n = 200_000
    timed = 0.02 * 1.5  # a step of 20 ms at the host model's factor 1.5
    assert sum(s.step(timed, 1.5) for _ in range(n)) / n == pytest.approx(timed, rel=0.03)
    assert {s.step(0.02, 1.0) for _ in range(1000)} == {0.02}
    lags = [s.path(0.08) for _ in range(n)]
    assert sum(lags) / n == pytest.approx(0.08, rel=0.03) and max(lags) > 0.3


def test_stalls_load_from_a_profile_file_and_bad_ones_are_refused(tmp_path, base):
    entry = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("name", "host_cpu", "stalls")}
    entry["stalls"] = STALLS.to_json()
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"profiles": {"x": entry}}))
    assert load_profile(f"{path}#x").stalls == STALLS
    for bad in ({"step_rate_per_s": 1.0}, {"request_p": 1.5, "request_lengths_s": [0.1]}, {"path_lengths_s": [0.1]},
                {"when": 1}):
        entry["stalls"] = bad
        path.write_text(json.dumps({"profiles": {"x": entry}}))
        with pytest.raises(ConfigError, match="stalls"):
            load_profile(f"{path}#x")
