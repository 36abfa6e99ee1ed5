"""Host-wide stalls (``Stalls.host_wide``, engines.emulated.host_stalls): one event process per run that
every engine's steps, the ways in and the client's path share; each part keeps its measured mean, the
correlation changes; a run is reproducible from its seed and the path's post-pass sees the engines' events."""

from __future__ import annotations

import dataclasses
import json

import pytest

from engines.emulated.host_stalls import HostStallSampler, HostTimeline, samplers
from engines.emulated.profile import load_profile
from engines.emulated.stalls import Stalls
from gpuhit.errors import ConfigError
from tests.engines.emulated.test_stalls import STALLS, _run

WIDE = dataclasses.replace(STALLS, host_wide=True)


def test_events_are_a_poisson_process_at_the_steps_rate_and_the_same_seed_gives_the_same():
    t = HostTimeline.of(WIDE, 5)
    n = len(t.events(0.0, 10_000.0))
    assert n == pytest.approx(4.0 * 10_000, rel=0.03)
    again = HostTimeline.of(WIDE, 5)
    assert again.events(100.0, 101.0) == HostTimeline.of(WIDE, 5).events(100.0, 101.0) == t.events(100.0, 101.0)
    assert HostTimeline.of(WIDE, 6).events(100.0, 101.0) != t.events(100.0, 101.0)
    with pytest.raises(ConfigError, match="positive event rate"):
        HostTimeline.of(Stalls(request_p=0.2, request_lengths_s=(0.1,), host_wide=True), 1)


def test_every_part_keeps_its_measured_mean():
    s = HostStallSampler(WIDE, HostTimeline.of(WIDE, 3))
    n, step = 100_000, 0.02
    added = sum(s.step(step, None, i * step) - step for i in range(n))
    assert added / (n * step) == pytest.approx(WIDE.mean_step_excess(), rel=0.05)
    # requests and paths arriving far apart (independent windows): the measured probabilities and means
    req = [s.request(i * 10.0) for i in range(n)]
    assert sum(req) / n == pytest.approx(WIDE.mean_request_excess(), rel=0.05)
    assert sum(x > 0 for x in req) / n == pytest.approx(WIDE.request_p, rel=0.05)
    lags = [s.path(0.08, i * 10.0 + 3.0) for i in range(n)]
    assert sum(lags) / n == pytest.approx(0.08, rel=0.05)
    timed = 0.03  # under a host model's factor 1.5: the mean step stays the host model's
    assert sum(s.step(timed, 1.5, i * timed) for i in range(n)) / n == pytest.approx(timed, rel=0.05)
    assert s.step(0.02, 1.0, 5.0) == 0.02


def test_two_engines_stall_together_where_independent_draws_do_not():
    wide = samplers(WIDE, 9)
    a, b = wide(0), wide(1)
    own = samplers(STALLS, 9)
    c, d = own(0), own(1)
    n, step = 20_000, 0.02

    def both(x, y):
        hits = [(x.step(step, None, i * step) > step, y.step(step, None, i * step) > step) for i in range(n)]
        pa, pb = sum(h[0] for h in hits) / n, sum(h[1] for h in hits) / n
        return sum(h[0] and h[1] for h in hits) / n / (pa * pb)

    assert both(a, b) > 5  # the same events: stalled together far above chance
    assert both(c, d) == pytest.approx(1.0, abs=0.3)  # independent draws: at chance


def test_a_run_is_reproducible_and_differs_from_independent_draws():
    base = load_profile("qwen3-coder-30b-a3b@h20")
    prof = dataclasses.replace(base, stalls=WIDE)
    a, b = _run(prof, 1), _run(prof, 1)
    assert a == b
    assert a != _run(dataclasses.replace(base, stalls=STALLS), 1) and a != _run(base, 1)


def test_host_wide_loads_from_a_profile_file_and_is_written_only_when_set(tmp_path):
    base = load_profile("qwen3-coder-30b-a3b@h20")
    assert "host_wide" not in STALLS.to_json() and WIDE.to_json()["host_wide"] is True
    entry = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("name", "host_cpu", "stalls")}
    path = tmp_path / "p.json"
    for stalls, want in ((WIDE.to_json(), WIDE), (STALLS.to_json(), STALLS)):
        entry["stalls"] = stalls
        path.write_text(json.dumps({"profiles": {"x": entry}}))
        assert load_profile(f"{path}#x").stalls == want
    entry["stalls"] = {**WIDE.to_json(), "host_wide": "yes"}
    path.write_text(json.dumps({"profiles": {"x": entry}}))
    with pytest.raises(ConfigError, match="host_wide"):
        load_profile(f"{path}#x")


def test_the_path_post_pass_meets_the_events_the_engines_met():
    from replayer.live_path import LivePathModel, delay_first_chunks
    from replayer.records import RequestRecord

    recs = [RequestRecord(session="s", turn=i, arrival=0.5 * i, first_token=0.5 * i + 0.1, finish=0.5 * i + 0.2,
                          output_tokens=2, input_tokens=10) for i in range(400)]
    applied = delay_first_chunks(recs, LivePathModel(((0, 0.08),)), whole=True, stalls=WIDE, seed=4)
    engine_view = HostStallSampler(WIDE, HostTimeline.of(WIDE, 4))
    assert list(applied) == pytest.approx([engine_view.path(0.08, 0.5 * i) for i in range(400)])
