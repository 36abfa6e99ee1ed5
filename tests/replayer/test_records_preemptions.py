"""The ``preemptions`` column: written, read back, and an older records file (without it) still resumes."""

from __future__ import annotations

from replayer.records import COLUMNS, RecordWriter, RequestRecord, read_records


def test_preemptions_round_trip_and_resume_of_a_file_without_the_column(tmp_path):
    new = tmp_path / "new.csv"
    with RecordWriter(new, resume=False) as w:
        w.write(RequestRecord(session="s", turn=0, preemptions=2))
    assert read_records(new)["preemptions"].tolist() == [2]
    old = tmp_path / "old.csv"
    old_cols = COLUMNS[: COLUMNS.index("note") + 1]
    old.write_text(",".join(old_cols) + "\n" + ",".join("s" if c == "session" else "0" if c in ("seed", "turn") else ""
                                                     for c in old_cols) + "\n")
    with RecordWriter(old, resume=True) as w:
        assert w.done == {("s", 0)}
        w.write(RequestRecord(session="s", turn=1, preemptions=3))
    lines = old.read_text().splitlines()
    assert lines[0] == ",".join(old_cols) and len(lines[2].split(",")) == len(old_cols)
