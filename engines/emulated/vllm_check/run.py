"""Run workloads on both sides and compare (the test and ``gpuhit emulate-check`` use this)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterable
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
                              capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0 or not dst.exists():
            raise GpuhitError(f"the vLLM side failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(dst.read_text())["streams"]


#: how the emulator side runs: its scheduler stepped directly, or the engine's own asyncio step
#: loop on the virtual clock without / with the decode jump (compared at the boundaries it exposes)
MODES = ("step", "loop", "jump")


@dataclass
class ConfigResult:
    streams: int = 0
    steps: int = 0
    boundaries: int = 0  # records compared (steps, or jumps' merged steps as one)
    unaligned: int = 0  # loop/jump streams whose steps left the workload's grid (see emu_side.Unaligned)
    mismatching_streams: list[str] = field(default_factory=list)
    first_report: str | None = None


def _emulate(w: dict[str, Any], mode: str) -> list[dict]:
    if mode == "step":
        return emu_side.run_stream(w)
    return emu_side.run_stream_async(w, jump_decode=mode == "jump")


def check(streams: list[dict[str, Any]], python: pathlib.Path | str, modes: Iterable[str] = ("step",),
          theirs: list[Any] | None = None) -> dict[str, ConfigResult]:
    """Compare every stream in every mode; results per (configuration, mode) ("bs16-small", or
    "bs16-small [jump]" for the other modes). ``theirs``: vLLM's records if already run."""
    if theirs is None:
        theirs = run_vllm(streams, python)
    results: dict[str, ConfigResult] = {}
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        for w, v in zip(streams, theirs):
            cfg = w["name"].split("/")[0] + ("" if mode == "step" else f" [{mode}]")
            res = results.setdefault(cfg, ConfigResult())
            res.streams += 1
            if isinstance(v, dict):
                res.mismatching_streams.append(w["name"])
                res.first_report = res.first_report or f"{w['name']}: vLLM side error: {v.get('error')}"
                continue
            try:
                mine = _emulate(w, mode)
            except emu_side.Unaligned:
                res.unaligned += 1
                continue
            except Exception as exc:  # noqa: BLE001 - a crash is a mismatch, reported like one
                res.mismatching_streams.append(w["name"])
                res.first_report = res.first_report or f"{w['name']}: emulator error: {exc!r}"
                continue
            if mode == "step":
                n, report = compare.compare_stream(v, mine)
                res.boundaries += n
            else:
                n, report = compare.compare_boundaries(v, mine)
                res.boundaries += len(mine)
            res.steps += n
            if report is not None:
                res.mismatching_streams.append(w["name"])
                res.first_report = res.first_report or f"{w['name']} ({mode}): {report}"
    return results


def format_results(results: dict[str, ConfigResult]) -> str:
    lines = [(f"{'configuration [mode]':<33} {'streams':>7} {'steps':>8} {'records':>8} {'unaligned':>9} "
              f"{'mismatching':>11}")]
    for name, r in results.items():
        lines.append(f"{name:<33} {r.streams:>7} {r.steps:>8} {r.boundaries:>8} {r.unaligned:>9} "
                     f"{len(r.mismatching_streams):>11}")
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
    cfgs = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else list(workload.CONFIGS)
    modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["step"]
    res = check(main_streams(cfgs, n, 0), require_python(), modes)
    print(format_results(res))
    sys.exit(1 if any(r.mismatching_streams for r in res.values()) else 0)
