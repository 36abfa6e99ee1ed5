"""One simulated run as a job, and the resumable results folder runs are saved into.

A replay, a sweep and the A/B protocol are all made of independent *runs* (one policy
configuration, one seed, one trace). Each is described by a *job* dict (its ``spec`` with
``label``/``policy``/``roles``/``seed``, its ``index`` in the plan, the ``records`` CSV and
``result`` JSON paths, and the simulation options) and executed by :func:`run_one` wherever an
executor (:mod:`replayer.executors`) puts it. A run's results are written the moment it finishes,
so an interrupted comparison keeps every finished run and ``--resume`` redoes none of them.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from gpuhit.errors import ConfigError

_SYNTHS: dict[tuple[int, int], Any] = {}  # this process's synthesizers, see synth_for


def policy_type(cfg: Any) -> str:
    """The registered type of a policy given by name or as ``{name, type, params}``."""
    if isinstance(cfg, str):
        return cfg
    return str(cfg.get("type") or cfg.get("name"))


def safe(label: str) -> str:
    """``label`` as a file-name part."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def run_name(label: str, seed: int) -> str:
    """The name of a run's files in a results folder (``records/<name>.csv``, ``runs/<name>.json``)."""
    return f"{safe(label)}-seed{seed}"


# Relative simulation cost of a run by policy type (wall seconds per run over a plain cache-aware
# policy's, measured on full weka_cc at 0.008 sessions/s, one seed: PD 2.0, lpwl_migrate 1.5,
# least_request 1.3, round_robin 1.15, route_query 1.1). It orders the runs, longest first; no
# result depends on it. PD: two steps per request and jammed pools; migration: KV moved around;
# load-only policies: lower hit rates, so more blocks to compute.
_RUN_COST = {"pd_disagg": 2.0, "lpwl_migrate": 1.5, "least_request": 1.3, "round_robin": 1.15, "route_query": 1.1}


def _run_cost(spec: Any) -> float:
    return _RUN_COST["pd_disagg"] if spec.roles is not None else _RUN_COST.get(policy_type(spec.policy), 1.0)


def longest_first(specs: Sequence[Any]) -> list[int]:
    """Indices of ``specs`` in the order to start them: costliest first, then as given."""
    return sorted(range(len(specs)), key=lambda i: (-_run_cost(specs[i]), i))


def synth_for(seed: int, block_size: int) -> Any:
    """This process's token synthesizer for (seed, block size), shared by the runs it does.

    Why: hashing a trace's prompts cold is ~2 s of a 10-20 s run of the bundled slice, and every
    policy's run of one seed hashes the same prompts; a worker's later runs reuse the memo.
    """
    from replayer.synth import TokenSynthesizer

    key = (seed, block_size)
    synth = _SYNTHS.get(key)
    if synth is None:
        synth = _SYNTHS[key] = TokenSynthesizer(seed=seed, engine_block_size=block_size, identity="chain")
    return synth


def clear_synths() -> None:
    """Drop this process's synthesizer memo (it holds every hashed prompt of the runs done)."""
    _SYNTHS.clear()


def run_one(job: dict[str, Any], trace: Any, progress_q: Any = None) -> dict[str, Any]:
    """One simulation (in a worker process, inline, or a Ray task). Returns JSON-able results.

    ``progress_q`` receives ``(index, done, total, sim_time)`` at most four times a second.
    """
    from replayer.records import RecordWriter
    from replayer.simulate import simulate

    spec = job["spec"]
    idx = job["index"]
    last = [0.0]

    def progress(done: int, total: int, sim: float) -> None:
        if progress_q is None:
            return
        now = time.monotonic()
        if now - last[0] >= 0.25 or done == total:
            last[0] = now
            progress_q.put((idx, done, total, sim))

    path = pathlib.Path(job["records"])
    with RecordWriter(path, resume=False, policy=spec.label, seed=spec.seed) as w:
        res = simulate(
            trace, spec.policy, instances=job["instances"], profile=job["profile"], seed=spec.seed,
            roles=spec.roles, index=job["index_kind"], max_requests=job["max_requests"],
            max_sessions=job["max_sessions"], open_loop=job["open_loop"], progress=progress,
            sink=w.write, label=spec.label, block_size=job["block_size"],
            synth=synth_for(spec.seed, job["block_size"]),
            replicas=_replicas(job.get("replicas")),
            engine_kwargs={"block_size": job["block_size"], **job.get("engine_kwargs", {})}, **job["arrival"],
        )
    summary = res.summary()
    summary["label"] = spec.label
    summary["records"] = str(path)
    lat = [r.finish - r.arrival for r in res.records if r.ok]
    result = {"summary": summary, "latencies": lat, "util_series": res.util_series}
    if job.get("result"):
        save_run(pathlib.Path(job["result"]), result)  # as soon as it is done: Ctrl-C loses no finished run
    return result


def save_run(path: pathlib.Path, result: dict[str, Any]) -> None:
    """One finished run's summary, latencies and utilization series, written atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=jsonable), encoding="utf-8")
    os.replace(tmp, path)


def jsonable(x: Any) -> Any:
    """``json.dumps``' fallback: numpy scalars as Python numbers, anything else as its ``str``."""
    item = getattr(x, "item", None)
    return item() if callable(item) else str(x)


def start_folder(args: argparse.Namespace, tool: str) -> tuple[pathlib.Path, bool]:
    """(results folder, resuming?) of ``gpuhit <tool>``. ``--resume DIR`` restores the options saved
    in DIR/plan.json into ``args``; otherwise ``--out`` or ``results/[<tool>-]<UTC timestamp>``."""
    if args.resume is None:
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
        out = pathlib.Path(args.out) if args.out else pathlib.Path("results") / (
            stamp if tool == "replay" else f"{tool}-{stamp}")
        return out, False
    out = pathlib.Path(args.resume)
    if args.out is not None and pathlib.Path(args.out) != out:
        raise ConfigError("give --resume DIR alone (it writes into DIR), not with another --out")
    try:
        saved = json.loads((out / "plan.json").read_text(encoding="utf-8"))["options"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"--resume {out}: no readable plan.json there ({exc}); was it made by gpuhit {tool}?") from None
    for k, v in saved.items():
        setattr(args, k, v)
    return out, True


__all__ = ["clear_synths", "jsonable", "longest_first", "policy_type", "run_name", "run_one", "safe", "save_run",
           "start_folder", "synth_for"]


def _replicas(cfg: dict[str, Any] | None) -> Any:
    """The job's :class:`~replayer.replicas.ReplicaConfig` (None: one gateway replica)."""
    if not cfg:
        return None
    from replayer.replicas import ReplicaConfig

    return ReplicaConfig(**cfg)
