"""Lost-hit classification pinned on hand-made records, and the CLI on a results folder."""

from __future__ import annotations

import json
import math

import pandas as pd

from analysis import lost_hits
from replayer import cli
from replayer.records import COLUMNS, RecordWriter, RequestRecord

BS = 16


def rec(session, turn, instance, arrival, ft, fin, inp, pred, real, impl, **kw):
    return RequestRecord(run_id="r", policy="p", seed=0, session=session, turn=turn, instance=instance,
                         action="forward", arrival=arrival, first_token=ft, finish=fin, input_tokens=inp,
                         output_tokens=10, predicted_hit_tokens=pred, realized_hit_tokens=real,
                         implied_hit_tokens=impl, **kw)


RECORDS = [
    rec("a", 0, "gpu0", 0.0, 1.0, 2.0, 1000, 0, 0, 0),  # first turn, nothing implied: a hit by definition
    rec("a", 1, "gpu0", 10.0, 11.0, 12.0, 1200, 1000, 1000, 1000),  # full hit
    rec("a", 2, "gpu0", 20.0, 25.0, 26.0, 1400, 400, 100, 1200),  # idle 800 lost, queued 300
    rec("a", 3, "gpu1", 30.0, 31.0, 32.0, 1600, 0, 0, 1400),  # moved: cold instance
    rec("b", 0, "gpu1", 0.0, 1.0, 2.0, 500, 0, 0, 0),
    rec("b", 1, "gpu1", 5.0, 9.0, 10.0, 600, 496, 96, 496),  # seen at routing, evicted while queued: 400
    rec("b", 2, "gpu1", 12.0, 13.0, 14.0, 700, 592, 0, 592, preemptions=1),  # preempted
    rec("b", 3, "", 15.0, math.nan, 15.0, 9000, 0, 0, 688, error="too long", rejected=1),
]


def frame():
    return pd.DataFrame([{c: getattr(r, c) for c in COLUMNS} for r in RECORDS])


def test_classify_reasons_and_token_split():
    df = lost_hits.classify(frame(), BS).set_index(["session", "turn"])
    assert df["reason"].to_dict() == {
        ("a", 0): "hit", ("a", 1): "hit", ("a", 2): "evicted_idle", ("a", 3): "cold_instance",
        ("b", 0): "hit", ("b", 1): "evicted_queued", ("b", 2): "preempted", ("b", 3): "rejected",
    }
    assert (df.loc[("a", 2), "lost_idle"], df.loc[("a", 2), "lost_queued"], df.loc[("a", 2), "lost"]) == (800, 300, 1100)
    assert df.loc[("b", 1), "lost_queued"] == 400 and df.loc[("b", 2), "lost_queued"] == 0
    s = lost_hits.run_summary(df.reset_index())
    assert s["implied"] == 1000 + 1200 + 1400 + 496 + 592 and s["implied_rejected"] == 688
    assert s["lost"] == 1100 + 1400 + 400 + 592
    assert (s["n_hit"], s["n_evicted_idle"], s["n_evicted_queued"], s["n_preempted"], s["n_cold_instance"],
            s["n_rejected"]) == (3, 1, 1, 1, 1, 1)
    assert (s["lost_evicted_idle"], s["lost_evicted_queued"], s["lost_cold_instance"]) == (800, 700, 1400)


def test_instance_timeline_counts_queued_decoding_active_idle_and_lost():
    df = lost_hits.classify(frame(), BS)
    tl = lost_hits.instance_timeline(df, 1.0)
    g0 = tl["gpu0"]
    t = g0["t"]
    at = {x: i for i, x in enumerate(t)}
    assert g0["queued_prefill"][at[22.0]] == 1400 - 100  # a2 arrived 20, first token 25
    assert g0["decodes"][at[25.0]] == 1 and g0["decodes"][at[24.0]] == 0
    assert g0["active_kv"][at[21.0]] == 1410
    assert g0["idle_live_kv"][at[5.0]] == 1010  # a0 finished at 2, a1 back here at 10
    assert g0["idle_live_kv"][at[28.0]] == 0  # a3 went to gpu1: nothing to keep for it on gpu0
    assert g0["lost_hits"][at[20.0]] == 1100 and sum(g0["lost_hits"]) == 1100
    rows = lost_hits.instance_summary(tl, 1200.0, df)
    assert [r["instance"] for r in rows] == ["gpu0", "gpu1"] and rows[0]["requests"] == 3


def test_cli_prints_the_section_and_writes_plots(tmp_path, capsys):
    (tmp_path / "records").mkdir()
    with RecordWriter(tmp_path / "records" / "p-seed0.csv", resume=False) as w:
        for r in RECORDS:
            w.write(r)
    (tmp_path / "plan.json").write_text(json.dumps({"options": {"block_size": 16, "profile": None}}))
    assert cli.main(["lost-hits", str(tmp_path), "--bin", "1", "--plots", str(tmp_path / "lh")]) == 0
    out = capsys.readouterr().out
    assert "## Lost hits" in out and "| p-seed0 |" in out and "KV capacity per instance: 203440 tokens" in out
    assert (tmp_path / "lh" / "lost-hits-p-seed0.png").stat().st_size > 0
    assert cli.main(["lost-hits", str(tmp_path / "lh")]) == 2  # not a results folder: a clear error
