import math

import pytest

from gpuhit.errors import ConfigError
from replayer.records import COLUMNS, RecordWriter, RequestRecord, read_records, records_to_frame


def rec(session, turn, error="", policy="lpwl", seed=0):
    return RequestRecord(run_id="r", policy=policy, seed=seed, session=session, turn=turn, instance="i1",
                         action="forward", reason="min work", arrival=1.5, first_token=2.25, finish=3.0,
                         input_tokens=100, output_tokens=5, predicted_hit_tokens=64, realized_hit_tokens=48,
                         implied_hit_tokens=64, error=error)


def test_append_flush_and_read_back(tmp_path):
    p = tmp_path / "run.csv"
    w = RecordWriter(p, policy="lpwl", seed=0)
    w.write(rec("a", 0))
    # flushed per row: readable before close
    assert read_records(p)["session"].tolist() == ["a"]
    w.write(rec("a", 1, error="EngineError: boom, with comma"))
    w.write(RequestRecord(session="b", turn=0, error="not sent: x"))
    w.close()
    df = read_records(p)
    assert list(df.columns) == list(COLUMNS)
    assert df["turn"].tolist() == [0, 1, 0]
    assert df["error"].tolist() == ["", "EngineError: boom, with comma", "not sent: x"]
    assert df["first_token"].tolist()[:2] == [2.25, 2.25] and math.isnan(df["arrival"].iloc[2])
    assert df["realized_hit_tokens"].tolist() == [48, 48, 0]


def test_resume_skips_done_turns_and_repairs_torn_row(tmp_path):
    p = tmp_path / "run.csv"
    with RecordWriter(p) as w:
        w.write(rec("a", 0))
        w.write(rec("a", 1, error="EngineError: x"))
    with open(p, "a") as fh:
        fh.write("r,lpwl,0,a,,2,i1")  # a crash mid-row
    w = RecordWriter(p, policy="lpwl", seed=0)
    assert w.done == {("a", 0), ("a", 1)} and w.resumed_rows == 2
    w.write(rec("a", 2))
    w.close()
    assert read_records(p)["turn"].tolist() == [0, 1, 2]


def test_resume_into_other_run_or_refused(tmp_path):
    p = tmp_path / "run.csv"
    with RecordWriter(p) as w:
        w.write(rec("a", 0))
    with pytest.raises(ConfigError, match="policy"):
        RecordWriter(p, policy="sticky")
    with pytest.raises(ConfigError, match="seed"):
        RecordWriter(p, seed=4)
    with pytest.raises(ConfigError, match="exists"):
        RecordWriter(p, resume=False)
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match="not a gpuhit records file"):
        RecordWriter(tmp_path / "x.csv")


def test_frame_from_records():
    df = records_to_frame([rec("a", 0), rec("b", 3)])
    assert df["session"].tolist() == ["a", "b"] and df.shape == (2, len(COLUMNS))
