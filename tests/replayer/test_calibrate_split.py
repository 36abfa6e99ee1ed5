"""``gpuhit profile path-split``: the share of the live path before the engine, from a live folder's
span-joined records, written into a profile that ``--live-path split`` then reads."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from engines.emulated.profile import load_profile
from gpuhit.errors import ConfigError
from replayer.calibrate_split import main
from replayer.live_path import path_models
from replayer.records import RecordWriter, RequestRecord
from tests.replayer.test_gap_split import rec


def live_folder(tmp_path, engine_timing=True):
    live = tmp_path / "ab"
    (live / "rate-3" / "runs").mkdir(parents=True)
    (live / "rate-3" / "records").mkdir()
    (live / "experiment.json").write_text(json.dumps({"rates": [3.0], "policies": ["lpwl"]}))
    path = live / "rate-3" / "records" / "lpwl-seed0.csv"
    with RecordWriter(path, engine_columns=engine_timing) as w:
        for k, parts in enumerate([(0.010, 0.002, 0.0, 0.1, 0.05, 0.030), (0.030, 0.002, 0.0, 0.1, 0.05, 0.010)]):
            r = rec("s", k, parts)
            w.write(r if engine_timing else RequestRecord(session="s", turn=k, arrival=r.arrival,
                                                          first_token=r.first_token, finish=r.finish))
    (live / "rate-3" / "runs" / "lpwl-s0.json").write_text(json.dumps({"policy": "lpwl", "seed": 0,
                                                                        "records": str(path)}))
    return live


def profile_file(tmp_path):
    base = load_profile("qwen3-coder-30b-a3b@h20")
    entry = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("name", "host_cpu", "stalls")}
    entry["fit"] = {"live_path": {"direct_path_s": 0.003, "gateway_ttft_s": 0.002,
                                  "by_in_flight": [{"in_flight": 0.0, "path_s": 0.005}, {"in_flight": 2.0, "path_s": 0.045}]}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"profiles": {"x": entry}}))
    return path


def test_the_share_is_written_into_the_profile_and_split_reads_it(tmp_path, capsys):
    prof = profile_file(tmp_path)
    out = tmp_path / "q.json"
    assert main(SimpleNamespace(profile=f"{prof}#x", live=str(live_folder(tmp_path)), out=str(out))) == 0
    assert "before_share 0.500" in capsys.readouterr().out
    p = load_profile(f"{out}#x")
    lp = p.fit["live_path"]
    assert lp["before_share"] == pytest.approx(0.5) and lp["before_share_from"]["n"] == 2
    assert path_models(p, "split")[2]["before_share"] == pytest.approx(0.5)
    assert "before_share" not in json.loads(prof.read_text())["profiles"]["x"]["fit"]["live_path"]  # --out: untouched


def test_a_folder_without_engine_spans_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no engine timing"):
        main(SimpleNamespace(profile=str(profile_file(tmp_path)), live=str(live_folder(tmp_path, False)), out=None))
    with pytest.raises(ConfigError, match="experiment.json"):
        main(SimpleNamespace(profile=str(profile_file(tmp_path)), live=str(tmp_path), out=None))
