"""Run workloads on both sides and compare (the test and ``gpuhit emulate-check`` use this)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engines.emulated.vllm_check import compare, emu_side
from gpuhit.errors import ConfigError, GpuhitError

VLLM_SIDE = pathlib.Path(__file__).with_name("vllm_side.py")
ENV_VAR = "GPUHIT_VLLM_PYTHON"


def vllm_python() -> pathlib.Path | None:
    """The vLLM venv's python (``engines.vllm.venv`` when present, else ``$GPUHIT_VLLM_PYTHON`` or
    ``<repo>/.venv-vllm/bin/python``); None if absent."""
    try:
        from engines.vllm.venv import vllm_python as found
    except ImportError:
        root = pathlib.Path(__file__).resolve().parents[3]
        p = pathlib.Path(os.environ.get(ENV_VAR) or root / ".venv-vllm" / "bin" / "python")
        return p if p.exists() else None
    return found()


def run_vllm(streams: list[dict[str, Any]], python: pathlib.Path | str, timeout: float = 1800) -> list[Any]:
    """Per-stream step records from vLLM's scheduler (one subprocess for the whole batch)."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = pathlib.Path(d, "in.json"), pathlib.Path(d, "out.json")
        src.write_text(json.dumps({"streams": streams}))
        env = dict(os.environ, PYTHONHASHSEED=emu_side.HASH_SEED, VLLM_LOGGING_LEVEL="ERROR",
                   VLLM_TARGET_DEVICE="cpu")
        env.pop("PYTHONPATH", None)  # the vLLM venv must not see gpuhit's tree
        proc = subprocess.run([str(python), str(VLLM_SIDE), str(src), str(dst)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not dst.exists():
            raise GpuhitError(f"the vLLM side failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(dst.read_text())["streams"]


@dataclass
class ConfigResult:
    streams: int = 0
    steps: int = 0
    mismatching_streams: list[str] = field(default_factory=list)
    first_report: str | None = None


def check(streams: list[dict[str, Any]], python: pathlib.Path | str,
          emu_runner: Callable[[dict[str, Any]], list[dict]] = emu_side.run_stream) -> dict[str, ConfigResult]:
    """Compare every stream; results per configuration (the part of the name before '/')."""
    theirs = run_vllm(streams, python)
    results: dict[str, ConfigResult] = {}
    for w, v in zip(streams, theirs):
        cfg = w["name"].split("/")[0]
        res = results.setdefault(cfg, ConfigResult())
        res.streams += 1
        if isinstance(v, dict):
            res.mismatching_streams.append(w["name"])
            res.first_report = res.first_report or f"{w['name']}: vLLM side error: {v.get('error')}"
            continue
        try:
            mine = emu_runner(w)
        except Exception as exc:  # noqa: BLE001 - a crash is a mismatch, reported like one
            res.mismatching_streams.append(w["name"])
            res.first_report = res.first_report or f"{w['name']}: emulator error: {exc!r}"
            continue
        n, report = compare.compare_stream(v, mine)
        res.steps += n
        if report is not None:
            res.mismatching_streams.append(w["name"])
            res.first_report = res.first_report or f"{w['name']}: {report}"
    return results


def format_results(results: dict[str, ConfigResult]) -> str:
    lines = [f"{'configuration':<26} {'streams':>7} {'steps':>8} {'mismatching':>11}"]
    for name, r in results.items():
        lines.append(f"{name:<26} {r.streams:>7} {r.steps:>8} {len(r.mismatching_streams):>11}")
    for name, r in results.items():
        if r.first_report:
            lines.append(f"\nfirst mismatch in {name}:\n{r.first_report}")
    return "\n".join(lines)


def require_python() -> pathlib.Path:
    p = vllm_python()
    if p is None:
        raise ConfigError(f"no vLLM venv found (set ${ENV_VAR} to its python, or build .venv-vllm)")
    return p


def main_streams(configs: Iterable[str], n: int, seed: int) -> list[dict[str, Any]]:
    from engines.emulated.vllm_check import workload

    out: list[dict[str, Any]] = []
    for c in configs:
        if c not in workload.CONFIGS:
            raise ConfigError(f"unknown configuration {c!r}; choose from {', '.join(workload.CONFIGS)}")
        out.extend(workload.generated_streams(c, n, seed))
    return out


if __name__ == "__main__":  # python -m engines.emulated.vllm_check.run [N]
    from engines.emulated.vllm_check import workload

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    cfgs = sys.argv[2].split(",") if len(sys.argv) > 2 else list(workload.CONFIGS)
    res = check(main_streams(cfgs, n, 0), require_python())
    print(format_results(res))
    sys.exit(1 if any(r.mismatching_streams for r in res.values()) else 0)
