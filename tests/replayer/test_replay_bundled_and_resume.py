"""The replay prints its table for the bundled Mooncake and Azure traces (trace-timestamp
and concurrent arrivals), counts rejected and failed requests apart, shows every instance, and a
Ctrl-C'd simulated comparison resumes to the same table with no run redone and none lost."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from replayer.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONV = str(ROOT / "traces" / "weka_cc" / "trace_0256.json.gz")  # the longest bundled conversation


@pytest.mark.parametrize("trace,extra", [
    ("mooncake", ["--max-sessions", "6"]),  # --arrival trace is the Mooncake default
    ("azure", ["--max-sessions", "6"]),
    ("mooncake", ["--sessions-concurrent", "3", "--max-sessions", "5"]),
])
def test_bundled_traces_print_their_table(tmp_path, capsys, trace, extra):
    from replayer.loaders import bundled_path

    rc = main(["replay", "--trace", str(bundled_path(trace)), "--policies", "lpwl,round_robin", "--instances", "2",
               "--max-requests", "40", "--out", str(tmp_path / "r"), "--no-plots", "--jobs", "1", "--full-table", *extra])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err
    head = out.splitlines()[0]  # the headline: "Replayed <trace>: <n> sessions (+<m> sub-agent sessions), ..."
    n = int(extra[extra.index("--max-sessions") + 1])
    assert f": {n} sessions (+" in head, head  # the sessions replayed, not the trace's
    assert "lpwl" in out and "round_robin" in out and "per instance" in out


def test_summary_counts_rejected_failed_and_instances(tmp_path, capsys):
    # A 30,000-token max_model_len on tiny engines rejects this conversation's long prompts before routing.
    prof = tmp_path / "p.json"
    base = json.loads((ROOT / "engines" / "emulated" / "profiles.json").read_text())["profiles"]["llama-3.1-8b@h100"]
    prof.write_text(json.dumps({"profiles": {"small": dict(base, max_model_len=30_000)}}))
    rc = main(["replay", "--trace", CONV, "--policies", "round_robin", "--instances", "3", "--max-requests", "60",
               "--profile", str(prof), "--out", str(tmp_path / "r"), "--no-plots", "--json", "--jobs", "1"])
    assert rc == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["n_sent"] == 60 == run["n_ok"] + run["n_rejected"] + run["n_failed"]
    assert run["n_rejected"] > 0 and run["errors"] == run["n_rejected"] + run["n_failed"]
    assert all(k.startswith("rejected: This model's maximum context length is N tokens")
               for k in run["error_kinds"] if k.startswith("rejected"))
    assert run["latency_rows"] == "ok"
    inst = run["per_instance"]
    assert sorted(inst) == ["gpu0", "gpu1", "gpu2"]
    assert sum(v["routed"] for v in inst.values()) == run["n_sent"] - run["n_rejected"]  # rejected: never routed
    assert sum(v["ok"] for v in inst.values()) == run["n_ok"]
    assert all(0 <= v["gpu_util"] <= 1 for v in inst.values())


def _cmd(out: pathlib.Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "replayer.cli", "replay", "--trace", CONV, "--policies",
            "round_robin,lpwl,least_request", "--instances", "2", "--max-requests", "100", "--no-plots",
            "--jobs", "1", "--seeds", "0", *(["--out", str(out)] if out else []), *extra]


def _table(out: pathlib.Path) -> str:
    return (out / "comparison.txt").read_text().split("\n\n")[0]


@pytest.fixture
def ctrl_c_reaches_children():
    """SIGINT handled (not ignored) in this process while the test runs, so that the replay it starts
    starts with SIGINT's default disposition. A suite started in the background of a non-interactive
    shell (``cmd &``, as a CI runner may start it) inherits SIGINT ignored, an ignored signal stays
    ignored across fork and exec, and the replay would never see the Ctrl-C this test sends (it ran
    to its end and exited 0). A handler, unlike SIG_IGN, is reset to the default by exec."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


def test_ctrl_c_then_resume_gives_the_same_table(tmp_path, ctrl_c_reaches_children):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref), env=env, check=True, capture_output=True, timeout=600)

    out = tmp_path / "cut"
    proc = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own process group, like a terminal's job
    runs = out / "runs"
    try:
        while not (runs.is_dir() and any(runs.glob("*.json"))):  # poll the filesystem for the first finished run
            assert proc.poll() is None, proc.communicate()
            try:
                proc.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert b"Finish with: gpuhit replay --resume" in err
    saved = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.json")}
    assert 1 <= len(saved) < 3  # the first finished run is kept, the last one never ran
    assert not (out / "summary.json").exists()

    again = subprocess.run(_cmd(out), env=env, capture_output=True, timeout=600, check=False)
    assert again.returncode == 2 and b"--resume" in again.stderr  # the folder is not silently overwritten

    res = subprocess.run(_cmd(None, "--resume", str(out)), env=env, capture_output=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr
    assert f"{len(saved)} of 3 runs saved".encode() in res.stderr
    for name, mtime in saved.items():  # no finished run redone
        assert (out / "runs" / name).stat().st_mtime_ns == mtime
    assert _table(out) == _table(ref)  # none lost, same numbers
    doc = json.loads((out / "summary.json").read_text())
    assert len(doc["runs"]) == 3 and doc["meta"]["resumed"] is True


def test_busy_seconds_integrates_each_sample_over_its_own_interval():
    from replayer.live import busy_seconds

    rows = [(2.0, "a", 0.5), (1.0, "a", 1.0), (3.0, "b", 0.25), (4.0, "a", 0.0)]
    assert busy_seconds(rows, 0.0) == {"a": 1.0 * 1 + 0.5 * 1 + 0.0 * 2, "b": 0.75}


def test_zero_output_turns_are_sent_with_max_tokens_one_and_noted():
    from engines.vllm.protocol import request_max_tokens
    from gpuhit.errors import BadRequestError

    assert request_max_tokens(0, 100, 1000) == (1, "max_tokens 1: trace output 0 (vLLM refuses 0)")
    assert request_max_tokens(50, 990, 1000) == (10, "max_tokens clamped 50 -> 10 (max_model_len 1000)")
    assert request_max_tokens(5, 100, None) == (5, "")
    with pytest.raises(BadRequestError):
        request_max_tokens(5, 1000, 1000)
