"""`gpuhit compare`: seeds run into separate folders pooled into one table (real replays, tiny trace)."""

import json
import pathlib

import pytest

from analysis.cli_compare import merge
from gpuhit.errors import ConfigError
from replayer.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONV = [str(ROOT / "traces" / "weka_cc" / "trace_0008.json.gz"), str(ROOT / "traces" / "weka_cc" / "trace_0024.json.gz")]
TRACE_ARGS = ["--trace", CONV[0], "--trace", CONV[1]]


def _replay(out: pathlib.Path, seed: int, capsys, *extra: str) -> pathlib.Path:
    rc = main(["replay", *TRACE_ARGS, "--policies", "lpwl,round_robin", "--instances", "2",
               "--seeds", str(seed), "--out", str(out), "--no-plots", "--jobs", "1", *extra])
    capsys.readouterr()
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("cmp")
    made = []
    for seed in (0, 1):
        out = base / f"s{seed}"
        rc = main(["replay", *TRACE_ARGS, "--policies", "lpwl,round_robin", "--instances", "2",
                   "--seeds", str(seed), "--out", str(out), "--no-plots", "--jobs", "1", "--json"])
        assert rc == 0
        made.append(out)
    return made


def test_compare_pools_seeds_from_folders(folders, tmp_path, capsys):
    out = tmp_path / "pooled"
    rc = main(["compare", *map(str, folders), "--out", str(out), "--json"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["comparison"]["policies"] == ["lpwl", "round_robin"]
    assert doc["comparison"]["seeds"] == {"lpwl": [0, 1], "round_robin": [0, 1]}
    cell = doc["comparison"]["table"]["lpwl"]["latency_p90"]
    per_seed = [r["latency_p90"] for r in doc["runs"] if r["policy"] == "lpwl"]
    assert cell["n"] == 2 and cell["mean"] == pytest.approx(sum(per_seed) / 2)
    assert per_seed[0] != per_seed[1]  # the seeds really differ
    assert doc["meta"]["runs"] == 4 and len(doc["meta"]["commands"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["comparison.json", "comparison.txt", "report.html", "summary.json"]
    text = (out / "comparison.txt").read_text()
    assert "n = 2 seeds per policy" in text and "paired difference to lpwl" in text and "n = 2 pairs" in text
    d = doc["comparison"]["diff"]["round_robin"]["latency_p90"]
    rr = [r["latency_p90"] for r in doc["runs"] if r["policy"] == "round_robin"]
    assert d["n"] == 2 and d["mean"] == pytest.approx((rr[0] - per_seed[0] + rr[1] - per_seed[1]) / 2)


def test_compare_reference_option(folders, capsys):
    assert main(["compare", *map(str, folders), "--reference", "round_robin", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["comparison"]["reference"] == "round_robin" and list(doc["comparison"]["diff"]) == ["lpwl"]
    assert main(["compare", *map(str, folders), "--reference", "nope"]) == 2
    assert "reference policy 'nope'" in capsys.readouterr().err


def test_compare_text_output(folders, capsys):
    assert main(["compare", *map(str, folders)]) == 0
    text = capsys.readouterr().out
    assert "4 runs from 2 folders" in text and "±" in text


def test_compare_refuses_mixed_experiments_and_duplicates(folders, tmp_path, capsys):
    other = _replay(tmp_path / "rate", 2, capsys, "--session-rate", "0.5")
    with pytest.raises(ConfigError, match="different experiment.*session_rate"):
        merge([folders[0], other])
    with pytest.raises(ConfigError, match="lpwl seed 0 appears in both"):
        merge([folders[0], folders[0]])
    assert main(["compare", str(tmp_path / "nowhere")]) == 2
    assert "no summary.json" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        merge([bad])


def test_compare_verdict_on_real_replays(folders, tmp_path, capsys):
    """`--verdict`: lpwl under test against round_robin (a published baseline) over the two seeds."""
    out = tmp_path / "verdict"
    assert main(["compare", *map(str, folders), "--reference", "lpwl", "--verdict", "--margin", "0.05",
                 "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    v = doc["comparison"]["verdict"]
    assert v["reference"] == "lpwl" and v["baselines"] == ["round_robin"] and v["margin"] == 0.05
    assert v["family_size"] == 5 and v["pairs"] == {"round_robin": [0, 1]}
    col = v["per_column"]["latency_p90"]
    d = doc["comparison"]["diff"]["round_robin"]["latency_p90"]  # round_robin - lpwl; the verdict's is lpwl - round_robin
    assert col["tests"]["round_robin"]["mean"] == pytest.approx(-d["mean"]) and col["tests"]["round_robin"]["n"] == 2
    assert col["non_inferior"] == (col["min_margin"] < 0.05)
    assert "non-inferior at 5%" in (out / "comparison.txt").read_text()
    assert "Verdict: lpwl against 1 baseline" in (out / "report.html").read_text()
    assert json.loads((out / "comparison.json").read_text())["verdict"]["margin"] == 0.05
    assert main(["compare", *map(str, folders), "--reference", "lpwl", "--verdict"]) == 0
    text = capsys.readouterr().out
    assert "verdict: lpwl against 1 baseline (round_robin)" in text and "non-inferior at 1%" in text


def test_compare_verdict_bad_options(folders, capsys):
    base = ["compare", *map(str, folders), "--reference", "lpwl"]
    assert main([*base, "--verdict", "--margin", "0"]) == 2
    assert "margin" in capsys.readouterr().err
    assert main([*base, "--margin", "0.02"]) == 2
    assert "belong to --verdict" in capsys.readouterr().err
    assert main([*base, "--verdict", "--baselines", "round_robin,sticky"]) == 2
    assert "baselines not among the runs: sticky" in capsys.readouterr().err
    assert main(["compare", *map(str, folders), "--reference", "round_robin", "--verdict"]) == 0
    assert "verdict: round_robin against 1 baseline (lpwl)" in capsys.readouterr().out
