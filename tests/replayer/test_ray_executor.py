"""Runs on a local 2-CPU Ray give the same record files as the local executor, byte for byte.

One Ray instance serves the module (starting one costs ~10-20 s on a small machine); the executor
uses a connection that already exists and leaves it open.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra (pip install 'gpuhit[ray]')")

from replayer.cli import main

# A small replay of the bundled trace: 2 policies x 2 seeds, a few dozen requests per run.
SMALL = ["replay", "--max-sessions", "1", "--max-requests", "40", "--policies", "lpwl,lmetric",
         "--seeds", "0,1", "--no-plots", "--json"]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("local") / "res"
    assert main(SMALL + ["--out", str(out)]) == 0
    return out


def _records(out: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "records").glob("*.csv"))}


def test_ray_records_identical_to_local(local_ray, local_run, tmp_path, capsys):
    out = tmp_path / "ray"
    assert main(SMALL + ["--out", str(out), "--ray"]) == 0
    want = _records(local_run)
    assert sorted(want) == ["lmetric-seed0.csv", "lmetric-seed1.csv", "lpwl-seed0.csv", "lpwl-seed1.csv"]
    assert all(len(b.splitlines()) == 41 for b in want.values())  # header + 40 requests
    assert _records(out) == want
    assert sorted(p.name for p in (out / "runs").iterdir()) == [n.replace(".csv", ".json") for n in sorted(want)]
    summary = (out / "summary.json").read_text(encoding="utf-8")
    assert str(out / "records" / "lpwl-seed0.csv") in summary  # the driver's path, not the worker's temp file


def test_resume_on_ray_redoes_only_missing_runs(local_ray, local_run, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(local_run, out)
    (out / "runs" / "lmetric-seed1.json").unlink()  # as if interrupted while that run was going
    (out / "records" / "lmetric-seed1.csv").write_bytes(b"torn")
    kept = (out / "runs" / "lpwl-seed0.json").stat().st_mtime_ns
    assert main(["replay", "--resume", str(out), "--ray"]) == 0
    assert _records(out) == _records(local_run)
    assert (out / "runs" / "lpwl-seed0.json").stat().st_mtime_ns == kept


def test_killed_worker_is_retried_and_counted_once(local_ray, local_run, tmp_path, monkeypatch):
    """Every task's first attempt kills its worker process; Ray retries it; each run is written once."""
    from replayer import executors

    marks = tmp_path / "marks"
    marks.mkdir()
    real = executors.ray_task

    def dies_first(job, trace, progress):
        mark = marks / f"{job['index']}"
        if not mark.exists():
            mark.write_text("attempt 1 killed")
            os._exit(1)  # the worker process dies, as under the OOM killer or a lost node
        return real(job, trace, progress)

    monkeypatch.setattr(executors, "ray_task", dies_first)
    seen: list[int] = []
    orig = executors.run_ray

    def counting(*a, **kw):
        for idx, r in orig(*a, **kw):
            seen.append(idx)
            yield idx, r

    monkeypatch.setattr(executors, "run_ray", counting)
    out = tmp_path / "retried"
    assert main(SMALL + ["--out", str(out), "--ray"]) == 0
    assert sorted(seen) == [0, 1, 2, 3]  # each run delivered once
    assert sorted(p.name for p in marks.iterdir()) == ["0", "1", "2", "3"]  # each one was killed once
    assert _records(out) == _records(local_run)


def test_sweep_on_ray_matches_local_sweep(local_ray, tmp_path):
    """Two traces in the object store (Zipf redraws) and a KV axis: the same files as the local pool."""
    args = ["sweep", "--zipf", "0,1.4", "--kv-gib", "20", "--policies", "lpwl,lmetric", "--seeds", "1",
            "--max-sessions", "2", "--max-requests", "20", "--json"]
    assert main(args + ["--out", str(tmp_path / "local")]) == 0
    assert main(args + ["--out", str(tmp_path / "ray"), "--ray"]) == 0

    def files(root: pathlib.Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("points/*/records/*.csv"))}

    want = files(tmp_path / "local")
    assert len(want) == 4
    assert files(tmp_path / "ray") == want
    rows = (tmp_path / "ray" / "summary.csv").read_text(encoding="utf-8").splitlines()
    assert len(rows) == 1 + 4


def test_replay_on_an_existing_cluster_by_address(local_ray, local_run, tmp_path):
    """Another process connects by address (as to a remote cluster) and ships this checkout's code."""
    addr = ray.get_runtime_context().gcs_address
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("RAY_AUTH_MODE", "token" if (pathlib.Path.home() / ".ray" / "auth_token").exists() else "disabled")
    out = tmp_path / "addr"
    proc = subprocess.run([sys.executable, "-m", "replayer.cli", *SMALL, "--out", str(out), "--ray", addr],
                          check=False, capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _records(out) == _records(local_run)
