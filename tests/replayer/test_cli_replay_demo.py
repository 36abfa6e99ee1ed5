"""`gpuhit replay` with no policy named: the story's policies, GPU-hit-first as the reference, the
answer first; every policy and every column one flag away."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from gpuhit.errors import ConfigError
from policies.registry import available
from replayer import cli_replay
from replayer.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONV = str(ROOT / "traces" / "weka_cc" / "trace_0008.json.gz")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli_replay.register(parser.add_subparsers())
    return parser.parse_args(["replay", *argv])


def test_default_policies_and_reference():
    args = _args()
    specs = cli_replay.plan_runs(args)
    assert list(dict.fromkeys(s.label for s in specs)) == list(cli_replay.DEMO_POLICIES)
    assert {s.seed for s in specs} == set(range(cli_replay.COMPARE_SEEDS))
    assert cli_replay._reference(args, specs) == "lpwl_auto"
    every = cli_replay.plan_runs(_args("--all-policies", "--seeds", "0,1"))
    assert len({s.label for s in every}) == len(available())
    named = _args("--policies", "lpwl,round_robin", "--seeds", "0,1")
    assert cli_replay._reference(named, cli_replay.plan_runs(named)) is None  # compare's default: the first
    with pytest.raises(ConfigError, match="--reference 'nope'"):
        cli_replay._reference(_args("--reference", "nope"), specs)
    with pytest.raises(ConfigError, match="exclusive"):
        cli_replay.plan_runs(_args("--all-policies", "--policies", "lpwl"))


def test_text_output_opens_with_the_answer_and_folds_repeats(tmp_path, capsys):
    out = tmp_path / "r"
    rc = main(["replay", "--trace", CONV, "--instances", "2", "--max-requests", "12", "--num-seeds", "2",
               "--policies", "lpwl_resident_prio,round_robin,least_request", "--out", str(out), "--jobs", "1"])
    assert rc == 0
    cap = capsys.readouterr()
    lines = cap.out.splitlines()
    assert lines[0].startswith("Replayed trace_0008: 1 session (+0 sub-agent sessions), 12 requests per run")
    assert lines[1].startswith("latency p90: ") and "; TTFT p90: " in lines[1]
    assert lines[2].startswith(f"Report: {out}/report.html")
    assert "paired difference to lpwl_resident_prio" in cap.out and "--full-table" in cap.out
    assert "columns:" not in cap.out  # the legend is --full-table's
    assert cap.err.count("\n") == 6  # not a terminal: one plain line per finished run
    report = (out / "report.html").read_text()
    assert report.index("class='headline'") < report.index("<table") < report.index("<details>")
    assert (out / "p90_by_policy.png").read_bytes()[:4] == b"\x89PNG"
    rc = main(["replay", "--trace", CONV, "--instances", "2", "--max-requests", "12", "--seeds", "0,1",
               "--policies", "lpwl,round_robin", "--out", str(tmp_path / "f"), "--jobs", "1", "--no-plots",
               "--full-table"])
    assert rc == 0
    full = capsys.readouterr().out
    assert "columns:" in full and "run timings" in full and "per instance" in full
