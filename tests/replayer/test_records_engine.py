"""Engine-side columns of the records: written only when asked for, read back exactly, additive to the rest."""

import math

import pytest

from gpuhit.errors import ConfigError
from replayer.records import (
    COLUMNS,
    ENGINE_COLUMNS,
    TIMED_COLUMNS,
    EngineTimedRecord,
    RecordWriter,
    RequestRecord,
    read_records,
    records_to_frame,
    rewrite_records,
)


def timed(session, turn, **kw):
    base = {"run_id": "r", "policy": "lpwl", "seed": 0, "session": session, "turn": turn, "arrival": 1.0,
            "first_token": 1.25, "finish": 1.5, "input_tokens": 100, "output_tokens": 4, "trace_id": "ab" * 16,
            "engine_arrival": 1.01, "engine_queue": 0.02, "engine_prefill": 0.2, "engine_decode": 0.21,
            "engine_ttft": 0.23, "engine_e2e": 0.45}
    return EngineTimedRecord(**{**base, **kw})


def test_engine_columns_follow_the_record_columns():
    assert TIMED_COLUMNS[: len(COLUMNS)] == COLUMNS and TIMED_COLUMNS[len(COLUMNS):] == ENGINE_COLUMNS
    assert ENGINE_COLUMNS == ("trace_id", "engine_arrival", "engine_queue", "engine_prefill", "engine_decode",
                              "engine_ttft", "engine_e2e", "engine_missing")


def test_a_file_without_engine_columns_is_unchanged(tmp_path):
    """A timed record written without engine columns: the file is the one a plain record makes."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    with RecordWriter(a) as w:
        w.write(timed("s", 0))
    plain = RequestRecord(**{c: getattr(timed("s", 0), c) for c in COLUMNS})
    with RecordWriter(b) as w:
        w.write(plain)
    assert a.read_bytes() == b.read_bytes()
    assert list(read_records(a).columns) == list(COLUMNS)


def test_engine_columns_round_trip(tmp_path):
    p = tmp_path / "run.csv"
    with RecordWriter(p, engine_columns=True) as w:
        w.write(timed("s", 0))
        w.write(RequestRecord(policy="lpwl", session="s", turn=1, error="not sent: x"))  # plain: engine cells empty
        w.write(timed("s", 2, trace_id="cd" * 16, engine_queue=math.nan, engine_missing="no engine span"))
    df = read_records(p)
    assert list(df.columns) == list(TIMED_COLUMNS)
    assert df["trace_id"].tolist() == ["ab" * 16, "", "cd" * 16]
    assert df["engine_missing"].tolist() == ["", "", "no engine span"]
    assert df["engine_e2e"].iloc[0] == 0.45 and math.isnan(df["engine_e2e"].iloc[1])
    assert math.isnan(df["engine_queue"].iloc[2])
    # resume keeps the file's columns
    w = RecordWriter(p, policy="lpwl", seed=0)
    assert w.done == {("s", 0), ("s", 1), ("s", 2)}
    w.write(timed("s", 3))
    w.close()
    assert read_records(p)["engine_prefill"].iloc[3] == 0.2


def test_rewrite_adds_columns_known_after_the_run(tmp_path):
    p = tmp_path / "run.csv"
    recs = [timed("s", 0, engine_e2e=math.nan), timed("s", 1)]
    with RecordWriter(p, engine_columns=True) as w:
        for r in recs:
            w.write(r)
    recs[0].engine_e2e = 0.4
    rewrite_records(p, recs, TIMED_COLUMNS)
    assert read_records(p)["engine_e2e"].tolist() == [0.4, 0.45]
    assert not (tmp_path / "run.csv.tmp").exists()


def test_frame_has_engine_columns_only_when_records_do():
    assert list(records_to_frame([RequestRecord()]).columns) == list(COLUMNS)
    df = records_to_frame([RequestRecord(session="p"), timed("s", 0)])
    assert list(df.columns) == list(TIMED_COLUMNS)
    assert df["trace_id"].tolist() == ["", "ab" * 16] and math.isnan(df["engine_e2e"].iloc[0])


def test_a_foreign_header_is_refused(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text(",".join((*COLUMNS, "engine_e2e")) + "\n")
    with pytest.raises(ConfigError, match="not a gpuhit records file"):
        RecordWriter(p)
