"""gpuhit sweep: the grid, the presets, the Zipf redraw, one report, resume, and equality with replay."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

from gpuhit.errors import ConfigError
from replayer.cli import main
from replayer.cli_sweep import PRESETS
from replayer.sweep_grid import Point, grid, migrate_policies, zipf_resample
from replayer.trace import Session, Trace, Turn

SMALL = ["sweep", "--policies", "lpwl,lmetric", "--seeds", "2", "--max-sessions", "1", "--max-requests", "20"]


def _ns(**kw) -> argparse.Namespace:
    base = {"rates": None, "kv_gib": None, "zipf": None}
    base.update(kw)
    return argparse.Namespace(**base)


def test_grid_is_the_product_of_the_axes_given():
    pts = grid(_ns(rates="0.004,0.008", kv_gib="10,20"))
    assert [p.name for p in pts] == ["rate0.004_kv10GiB", "rate0.004_kv20GiB", "rate0.008_kv10GiB",
                                     "rate0.008_kv20GiB"]
    assert grid(_ns()) == [Point(None, None, None)]
    assert grid(_ns(zipf="0,1.2"))[1].trace_key == "zipf1.2"


@pytest.mark.parametrize("kw, msg", [({"rates": "0.1,x"}, "comma-separated numbers"),
                                     ({"rates": "0"}, "> 0"), ({"kv_gib": "10,10"}, "repeats"),
                                     ({"zipf": "-1"}, ">= 0"), ({"rates": ","}, "empty")])
def test_bad_axes_are_refused(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        grid(_ns(**kw))


def test_presets_cover_the_sensitivity_experiments():
    assert sorted(PRESETS) == ["kv", "migrate", "rate", "replicas", "zipf"]
    pols = migrate_policies()
    assert pols[0]["type"] == "lpwl" and len(pols) == 1 + 9
    assert {(p["params"]["t_hot_tokens"], p["params"]["t_cool_s"]) for p in pols[1:]} == {
        (h, c) for h in (8192, 32768, 131072) for c in (10.0, 30.0, 120.0)}
    from policies.registry import build

    for p in pols:
        build(p)  # every preset configuration is a valid policy


def _toy() -> Trace:
    t = Turn(input_length=32, output_length=4, hash_ids=(1, 2))
    sessions = [Session(f"c{i}", (t,), 16, f"c{i}", arrival=float(i)) for i in range(5)]
    sessions.append(Session("c0/sub", (t,), 16, "c0", arrival=0.5, parent="c0"))
    return Trace(name="toy", format="native", sessions=tuple(sessions))


def test_zipf_redraw_copies_conversations_with_their_subagents():
    tr = _toy()
    flat = zipf_resample(tr, 0.0, 50)
    skewed = zipf_resample(tr, 3.0, 50)
    assert zipf_resample(tr, 3.0, 50) == skewed  # a fixed draw
    roots_of = lambda x: [s.namespace for s in x.sessions if s.parent is None]
    assert len(roots_of(flat)) == len(roots_of(skewed)) == 50
    assert roots_of(skewed).count("c0") > 40 > roots_of(flat).count("c0")  # 1/zeta(3) = 83% on rank 1
    ids = [s.session_id for s in skewed.sessions]
    assert len(ids) == len(set(ids))
    for s in skewed.sessions:
        if s.parent is not None:  # each copy of c0 brings its own copy of the sub-agent
            assert s.session_id.startswith("c0/sub~") and s.parent == "c0~" + s.session_id.split("~")[1]
    assert [s.arrival for s in skewed.sessions if s.parent is None][:5] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_sweep_writes_one_report_and_resumes(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(SMALL + ["--rates", "0.004,0.008", "--kv-gib", "4,20", "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "summary.csv").read_text(encoding="utf-8").splitlines()))
    assert [(r["point"], r["policy"], r["seeds"]) for r in rows] == [
        (p, pol, "2") for p in ("rate0.004_kv4GiB", "rate0.004_kv20GiB", "rate0.008_kv4GiB", "rate0.008_kv20GiB")
        for pol in ("lpwl", "lmetric")]
    assert float(rows[0]["rate"]) == 0.004 and float(rows[0]["kv_gib"]) == 4.0
    report = (out / "report.txt").read_text(encoding="utf-8")
    assert report.count("== rate") == 4 and "KV 4 GiB per instance" in report
    assert "max_model_len 196608 -> 43680" in report  # what 4 GiB of the H20 profile holds
    first = (out / "points" / "rate0.008_kv20GiB" / "comparison.txt").read_text(encoding="utf-8")

    run = out / "points" / "rate0.008_kv20GiB" / "runs" / "lmetric-seed1.json"
    run.unlink()
    kept = (out / "points" / "rate0.004_kv4GiB" / "runs" / "lpwl-seed0.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["sweep", "--resume", str(out)]) == 0
    assert "15 of 16 runs saved, 1 to run" in capsys.readouterr().err
    assert run.exists()
    assert (out / "points" / "rate0.004_kv4GiB" / "runs" / "lpwl-seed0.json").stat().st_mtime_ns == kept
    assert (out / "points" / "rate0.008_kv20GiB" / "comparison.txt").read_text(encoding="utf-8") == first
    assert main(SMALL + ["--rates", "0.004", "--out", str(out)]) == 2  # a folder holding a sweep is not reused


def test_a_point_equals_the_same_replay(tmp_path):
    sw, rp = tmp_path / "sw", tmp_path / "rp"
    assert main(SMALL + ["--rates", "0.008", "--out", str(sw)]) == 0
    assert main(["replay", "--policies", "lpwl,lmetric", "--seeds", "0,1", "--max-sessions", "1",
                 "--max-requests", "20", "--session-rate", "0.008", "--no-plots", "--json", "--out", str(rp)]) == 0
    names = sorted(p.name for p in (rp / "records").iterdir())
    assert len(names) == 4
    for n in names:
        assert (sw / "points" / "rate0.008" / "records" / n).read_bytes() == (rp / "records" / n).read_bytes()
    doc = json.loads((sw / "sweep.json").read_text(encoding="utf-8"))
    assert doc["points"]["rate0.008"]["axes"] == {"rate": 0.008, "kv_gib": None, "zipf": None}
