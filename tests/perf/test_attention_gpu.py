"""GPU benchmark of the route-the-query attention: runs tests/perf/gpu_measure.py (smoke configuration) when CUDA is present.

The full measurement is ``PYTHONPATH=. python3 tests/perf/gpu_measure.py --out DIR``; its committed
result lives in engines/attention/measurements/. Here: the same code paths, printed, with checks
that nothing errored and that the fused kernel agrees with the reference partial to bf16 noise.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

pytestmark = pytest.mark.gpu


def test_gpu_measure_smoke(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False (run on a GPU machine)")
    import gpu_measure

    cfg = dataclasses.replace(gpu_measure.SMOKE)
    path = gpu_measure.run(cfg, tmp_path, ["a", "b", "c", "e", "d"])
    res = json.loads(path.read_text())
    print(json.dumps(res["comparison"], indent=1))
    assert res["errors"] == {}
    assert all(c.get("o_maxabs", 1.0) <= 0.05 for c in res["partial"]["fused_check"])
    assert res["crossover"]["maps"]["h100_ibgda"]["grid_mq_by_ct"]["1"]["2048"]["choice"] == "route"


def test_measurement_file_is_consistent():
    meas = sorted((pathlib.Path(__file__).resolve().parents[2] / "engines/attention/measurements").glob("*.json"))
    if not meas:
        pytest.skip("no committed GPU measurement")
    res = json.loads(meas[-1].read_text())
    assert res["errors"] == {}
    print(meas[-1].name, res["env"]["device"], json.dumps(res["calibration"]["prefill_fit3"]))
    assert res["calibration"]["prefill_fit3"]["mape_pct"] < 10
