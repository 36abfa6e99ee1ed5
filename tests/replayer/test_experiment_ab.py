"""`gpuhit experiment ab`: the knee rule, and the whole protocol on two bundled conversations (resumable)."""

import json
import pathlib

import pytest

from gpuhit.errors import ConfigError
from replayer.cli import main
from replayer.cli_replay import COMPARE_SEEDS, plan_runs
from replayer.experiment_ab import find_knee

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONV = [str(ROOT / "traces" / "weka_cc" / "trace_0008.json.gz"), str(ROOT / "traces" / "weka_cc" / "trace_0024.json.gz")]


def pt(rate, p90, apc):
    return {"rate": rate, "latency_p90": p90, "apc_realized": apc}


def test_knee_is_where_p90_explodes_or_apc_collapses():
    # the recorded full weka_cc lpwl sweep (analysis/results/weka_cc-2026-11-23.md): the knee is 0.008
    sweep = [pt(0.002, 43.16, 0.899), pt(0.004, 51.11, 0.878), pt(0.006, 55.88, 0.853), pt(0.008, 226.47, 0.453),
             pt(0.012, 334.51, 0.262)]
    k = find_knee(list(reversed(sweep)))
    assert k["knee"] == 0.008 and k["reached"] and "p90" in k["why"] and "APC" in k["why"]
    # APC collapse alone
    assert find_knee([pt(1, 10.0, 0.9), pt(2, 12.0, 0.85), pt(3, 13.0, 0.79)])["knee"] == 3
    # p90 explosion alone, measured against the best p90 at lower rates (a light load can be slower)
    assert find_knee([pt(1, 30.0, 0.9), pt(2, 10.0, 0.9), pt(3, 25.0, 0.9), pt(4, 19.0, 0.9)])["knee"] == 3
    none = find_knee([pt(1, 10.0, 0.9), pt(2, 11.0, 0.88)])
    assert none["knee"] == 2 and not none["reached"] and "sweep higher" in none["why"]
    with pytest.raises(ConfigError):
        find_knee([])


def _replay_args(*argv):
    from replayer.experiment_ab import _replay_parser

    return _replay_parser().parse_args(["replay", "--trace", CONV[0], *argv])


def test_replay_defaults_to_five_seeds_when_comparing(capsys):
    assert COMPARE_SEEDS == 5
    several = plan_runs(_replay_args("--policies", "lpwl,round_robin"))
    assert sorted({s.seed for s in several}) == [0, 1, 2, 3, 4] and len(several) == 10
    one = plan_runs(_replay_args("--policies", "lpwl"))
    assert [s.seed for s in one] == [0]
    plan_runs(_replay_args("--policies", "lpwl,round_robin", "--seeds", "3"))
    assert "one seed per policy: no interval" in capsys.readouterr().err


def test_experiment_ab_end_to_end_and_resume(tmp_path, capsys):
    out = tmp_path / "ab"
    argv = ["experiment", "ab", "--trace", CONV[0], "--trace", CONV[1], "--instances", "2",
            "--policies", "lpwl,round_robin", "--reference", "round_robin", "--rates", "0.01,1",
            "--seeds", "2", "--out", str(out), "--no-plots", "--jobs", "1", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    exp = doc["experiment"]
    assert [p["rate"] for p in exp["knee"]["sweep"]] == [0.01, 1.0]
    knee = exp["knee"]["knee"]
    assert exp["points"]["knee"]["rate"] == knee and exp["points"]["0.7x-knee"]["rate"] == pytest.approx(0.7 * knee)
    assert exp["points"]["1.3x-knee"]["rate"] == pytest.approx(1.3 * knee)
    assert [r["status"] for r in exp["replays"]] == ["ran"] * 5
    for label in ("0.7x-knee", "knee", "1.3x-knee"):
        c = doc["comparisons"][label]
        assert c["reference"] == "round_robin" and c["seeds"] == {"lpwl": [0, 1], "round_robin": [0, 1]}
        assert c["diff"]["lpwl"]["latency_p90"]["n"] == 2
        # the reference named, a published baseline beside it: its verdict at every point
        assert c["verdict"]["reference"] == "round_robin" and c["verdict"]["baselines"] == ["lpwl"]
        text = (out / f"comparison-{label}.txt").read_text()
        assert text.count("paired difference to round_robin") == 1 and "first-turn TTFT p90" in text
        assert "verdict: round_robin against 1 baseline (lpwl)" in text and "non-inferior at 1%" in text
    html = (out / "report.html").read_text()
    assert "Verdict: round_robin against 1 baseline" in html
    assert "Knee" in html and "<dt>amplif</dt>" in html and "Paired difference to round_robin" in html
    made = json.loads((out / "points" / f"knee-rate-{knee:.6g}" / "summary.json").read_text())["meta"]["command"]
    assert made.startswith("gpuhit replay --trace") and "--num-seeds 2" in made and "experiment ab" not in made
    records = sorted((out / "points" / f"knee-rate-{knee:.6g}" / "records").iterdir())
    stamps = [p.stat().st_mtime_ns for p in records]
    # run again: every run set is read back, none rerun
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in again["experiment"]["replays"]] == ["reused"] * 5
    assert [p.stat().st_mtime_ns for p in records] == stamps
    assert again["comparisons"]["knee"]["table"] == doc["comparisons"]["knee"]["table"]
    # an interrupted point (no summary.json, one run unsaved): resumed, only that run is redone
    point = out / "points" / f"knee-rate-{knee:.6g}"
    (point / "summary.json").unlink()
    lost = min((point / "runs").iterdir())
    lost.unlink()
    assert main(argv) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert sorted(r["status"] for r in resumed["experiment"]["replays"]) == ["ran"] + ["reused"] * 4
    redone = point / "records" / (lost.stem + ".csv")
    assert [p.stat().st_mtime_ns for p in records if p != redone] == [s for p, s in zip(records, stamps) if p != redone]
    assert resumed["comparisons"]["knee"]["table"] == doc["comparisons"]["knee"]["table"]
    # other options into the same folder: refused, never mixed with the runs already there
    changed = [("3" if a == "2" and argv[i - 1] == "--seeds" else a) for i, a in enumerate(argv)]
    assert main(changed) == 2
    assert "holds a different run set" in capsys.readouterr().err


def test_experiment_ab_bad_options(tmp_path, capsys):
    base = ["experiment", "ab", "--trace", CONV[0], "--out", str(tmp_path / "x")]
    assert main([*base, "--seeds", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert main([*base, "--rates", "0.01"]) == 2
    assert "at least 2 rates" in capsys.readouterr().err
    assert main([*base, "--low-factor", "1.5"]) == 2
    capsys.readouterr()
    assert main([*base, "--high-factor", "0.9"]) == 2
    assert "--high-factor" in capsys.readouterr().err
    assert main([*base, "--margin", "1"]) == 2
    assert "margin" in capsys.readouterr().err
