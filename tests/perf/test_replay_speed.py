"""Replay speed: the main job's wall time, and simulated/real time ratios (run by `make bench`).

Targets: the bundled default `gpuhit replay` (every policy, one seed, 8 instances) in
under 60 s, and the whole comparison over all 180 ../shared/traces/weka_cc conversations (every
policy, one seed, 8 instances) in under 10 minutes, on the 2-core reference machine.
Set GPUHIT_BENCH_FULL=0 to skip the long full-folder benchmark.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from replayer.cli import main


def _run(argv: list[str], capsys) -> tuple[dict, float]:
    t0 = time.perf_counter()
    rc = main(argv)
    wall = time.perf_counter() - t0
    assert rc == 0
    return json.loads(capsys.readouterr().out), wall


def _print(title: str, doc: dict, wall: float) -> None:
    runs = doc["runs"]
    reqs = sum(r["requests"] for r in runs)
    sim = sum(r["makespan"] for r in runs)
    cpu = sum(r["wall_s"] for r in runs)
    print(f"\n{title}: {len(runs)} runs, {reqs} requests, wall {wall:.1f} s "
          f"(sum of run walls {cpu:.1f} s, {reqs / cpu:.0f} requests/s per worker)")
    for r in runs:
        print(f"  {r['policy']:<22} makespan {r['makespan']:>9,.0f} s  wall {r['wall_s']:6.1f} s  "
              f"sim/wall {r['sim_wall_ratio']:>8,.0f}x  util med {100 * (r['gpu_util_median'] or 0):5.1f}%")
    print(f"  aggregate sim/wall {sim / wall:,.0f}x")


@pytest.mark.timeout(1800)
def test_bundled_default_under_60s(tmp_path, capsys):
    doc, wall = _run(["replay", "--out", str(tmp_path / "b"), "--json", "--no-plots"], capsys)
    _print("bundled default", doc, wall)
    assert wall < 60.0, f"bundled default took {wall:.1f} s (target < 60 s)"


@pytest.mark.timeout(3600)
def test_full_weka_cc_comparison_under_10min(tmp_path, capsys, shared_traces):
    if os.environ.get("GPUHIT_BENCH_FULL", "1") == "0":
        pytest.skip("GPUHIT_BENCH_FULL=0")
    folder = shared_traces / "weka_cc"
    doc, wall = _run(["replay", "--trace", str(folder), "--out", str(tmp_path / "f"), "--json", "--no-plots"],
                     capsys)
    _print("weka_cc (180 conversations)", doc, wall)
    assert wall < 600.0, f"full weka_cc comparison took {wall:.1f} s (target < 600 s)"
