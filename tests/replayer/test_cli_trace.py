"""``gpuhit trace stats|convert`` through the real CLI entry point."""

from __future__ import annotations

import json

from replayer.cli import main
from replayer.loaders import bundled_path, load_trace


def test_stats_table(capsys):
    assert main(["trace", "stats", str(bundled_path("mooncake"))]) == 0
    out = capsys.readouterr().out
    assert "requests       12,031" in out
    assert "span           3,537.0 s" in out
    assert "sessions       8,057 (8,057 root, 0 sub-agent)" in out
    assert "intra-session 31.5%" in out


def test_stats_json_and_no_inference(capsys):
    assert main(["trace", "stats", "--json", "--no-infer-sessions", str(bundled_path("mooncake"))]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["requests"], doc["sessions"], doc["skipped_records"]) == (12031, 12031, 0)
    assert doc["turns_per_session"]["max"] == 1.0


def test_stats_weka_folder_json(capsys):
    assert main(["trace", "stats", "--json", str(bundled_path("weka"))]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["sessions"], doc["child_sessions"], doc["requests"]) == (39, 19, 2357)


def test_skipped_records_reported_on_stderr(tmp_path, capsys):
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{oops\n')
    assert main(["trace", "stats", "--format", "mooncake", "--json", str(p)]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["skipped_records"] == 1
    assert "skipped 1 bad record(s)" in cap.err and f"{p}:2: bad JSON" in cap.err
    assert main(["trace", "stats", "--strict", "--format", "mooncake", str(p)]) == 2
    assert f"gpuhit: error: {p}:2: bad JSON" in capsys.readouterr().err


def test_convert_round_trip(tmp_path, capsys):
    out = tmp_path / "weka.jsonl.gz"
    src = bundled_path("weka") / "trace_0276.json.gz"
    assert main(["trace", "convert", str(src), "-o", str(out)]) == 0
    assert "5 sessions" in capsys.readouterr().out
    assert load_trace(out).trace == load_trace(src).trace


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["trace", "stats", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
