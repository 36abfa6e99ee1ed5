"""End to end: `gpuhit replay` through replayer.cli.main on 1-2 bundled conversations."""

import json
import pathlib

from replayer.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONV = [str(ROOT / "traces" / "weka_cc" / "trace_0008.json.gz"), str(ROOT / "traces" / "weka_cc" / "trace_0024.json.gz")]


def test_replay_json_table_and_files(tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["replay", "--trace", CONV[0], "--trace", CONV[1], "--policies", "lpwl,round_robin",
               "--instances", "2", "--out", str(out), "--no-plots", "--json", "--jobs", "1", "--seeds", "0"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["comparison"]["policies"] == ["lpwl", "round_robin"]
    assert doc["meta"]["arrival"] == "poisson" and doc["meta"]["instances"] == 2
    runs = {r["policy"]: r for r in doc["runs"]}
    assert set(runs) == {"lpwl", "round_robin"}
    for r in runs.values():
        assert r["requests"] == 102 and r["errors"] == 0 and r["completion_pct"] == 100.0
        assert 0 < r["gpu_util_median"] <= 1 and 0 < r["apc_realized"] <= r["apc_implied"] + 1e-9
    assert doc["comparison"]["table"]["lpwl"]["latency_p90"]["n"] == 1
    names = sorted(p.name for p in out.iterdir())
    assert names == ["comparison.json", "comparison.txt", "fairness.md", "lost_hits.md", "plan.json", "records",
                     "report.html", "runs", "summary.json"]
    assert "| lpwl-seed0 |" in (out / "lost_hits.md").read_text()
    assert sorted(p.name for p in (out / "records").iterdir()) == ["lpwl-seed0.csv", "round_robin-seed0.csv"]
    table = (out / "comparison.txt").read_text().splitlines()
    assert table[1].split()[0] == "policy" and table[3].startswith("lpwl") and table[4].startswith("round_robin")


def test_replay_text_output_with_plots_and_pd(tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["replay", "--trace", CONV[0], "--policies", "lpwl", "--pd", "1P+1D", "--instances", "2",
               "--out", str(out), "--jobs", "2", "--max-requests", "20", "--seeds", "0"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pd_disagg[1P+1D]" in text and "results:" in text
    for png in ("latency_cdf.png", "worker_ttft_p90.png", "gpu_utilization.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # the three comparison plots, then one lost-hit timeline per policy (its first seed)
    for run in ("lpwl-seed0", "pd_disagg_1P_1D_-seed0"):  # records/ file stems
        assert (out / f"lost-hits-{run}.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.html").read_text()
    assert report.count("data:image/png;base64,") == 5 and "Lost hits (gpuhit lost-hits)" in report


def test_unknown_policy_is_a_clear_error(tmp_path, capsys):
    rc = main(["replay", "--trace", CONV[0], "--policies", "lpwl,nope", "--out", str(tmp_path / "x")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown policy 'nope'" in err and "round_robin" in err


def test_policy_config_file_and_bad_options(tmp_path, capsys):
    cfg = tmp_path / "p.json"
    cfg.write_text(json.dumps([{"name": "rr", "type": "round_robin", "params": {}}]))
    rc = main(["replay", "--trace", CONV[0], "--policies", str(cfg), "--instances", "2", "--out",
               str(tmp_path / "o"), "--no-plots", "--json", "--max-requests", "5", "--num-seeds", "2", "--jobs", "1"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["comparison"]["policies"] == ["rr"] and doc["comparison"]["seeds"]["rr"] == [0, 1]
    assert main(["replay", "--trace", CONV[0], "--pd", "3P+3D", "--instances", "2"]) == 2
    assert "has 6 instances" in capsys.readouterr().err


def test_live_mode_unreachable_gateway_fails_fast(tmp_path, capsys):
    """--gateway: an unreachable gateway is one line and exit code 2, before anything is written."""
    out = tmp_path / "l"
    rc = main(["replay", "--trace", CONV[0], "--gateway", "http://127.0.0.1:9", "--max-requests", "3",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot reach the gateway at http://127.0.0.1:9" in err
    assert not out.exists()


def test_runs_are_started_longest_first():
    """PD and migration runs go to the workers first, so none starts last and idles a core."""
    from replayer.cli_replay import RunSpec
    from replayer.runs import longest_first

    specs = [RunSpec("lpwl", "lpwl", None, 0), RunSpec("lpwl_migrate", {"name": "m", "type": "lpwl_migrate"}, None, 0),
             RunSpec("pd_disagg[6P+2D]", "pd_disagg", ("prefill",) * 6 + ("decode",) * 2, 0),
             RunSpec("least_request", "least_request", None, 0)]
    assert [specs[i].label for i in longest_first(specs)] == ["pd_disagg[6P+2D]", "lpwl_migrate", "least_request", "lpwl"]
