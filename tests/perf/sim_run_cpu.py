"""CPU seconds of single simulated runs as the A/B protocol's workers run them (a benchmark script).

One line of JSON per run: the CPU seconds of the process (``time.process_time``), the record digest
(sha256 over every field of every record, as ``tests/replayer/test_records_pinned.py`` takes it, so a
speed-up that changes a record shows at once), the 1-minute load average, the time in the cyclic
garbage collector, and, for functions named in ``GPUHIT_TIME_FN``, their CPU seconds and calls.

The runs are those of ``gpuhit experiment ab --block-size 16 --policies <file> --knee K``: Poisson
sessions at the given rate, the replay options' defaults (8 instances, think times capped), seed 0,
block 16, one token synthesizer per (seed, block size) kept across the runs of the process, as a
protocol worker keeps it: the first run fills it, later runs reuse it. To compare two commits, run
this script from each one's checkout, interleaved, under the same load:

    python tests/perf/sim_run_cpu.py --code /tmp/base --trace <weka_cc folder> \\
        lpwl_auto:0.0056 lmetric:0.0056 lpwl_auto:0.008 lmetric:0.008
    GPUHIT_TIME_FN=engines.emulated.block_ids:FreeBlockQueue._scan python tests/perf/sim_run_cpu.py ...

``--code``: the checkout whose modules are imported (default: this one).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import importlib
import json
import os
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]


def digest(records: list[Any]) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(repr(dataclasses.astuple(r)).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def time_functions(specs: list[str]) -> dict[str, list[float]]:
    """Wrap each ``module:Class.method`` (or ``module:function``) to add up its CPU seconds."""
    acc: dict[str, list[float]] = {}
    for spec in specs:
        mod, attr = spec.split(":")
        owner: Any = importlib.import_module(mod)
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        real = getattr(owner, name)
        acc[attr] = slot = [0.0, 0]

        def timed(*a: Any, _real: Any = real, _slot: list = slot, **k: Any) -> Any:
            t = time.process_time()
            try:
                return _real(*a, **k)
            finally:
                _slot[0] += time.process_time() - t
                _slot[1] += 1

        setattr(owner, name, timed)
    return acc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="POLICY:RATE (a policy label of --policies, sessions/s)")
    ap.add_argument("--code", default=str(ROOT), help="the checkout to import (default: this one)")
    ap.add_argument("--trace", required=True, help="the trace folder or file (the WEKA weka_cc folder)")
    ap.add_argument("--policies", default="analysis/results/policy-protocol-b16-2026-11-27.policies.json",
                    help="the policy file, relative to --code")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, args.code)
    os.chdir(args.code)
    from replayer.cli_replay import plan_runs
    from replayer.experiment_ab import _replay_parser
    from replayer.replay_options import arrival_options, load_replay_trace
    from replayer.runs import synth_for
    from replayer.simulate import simulate

    gc_time = [0.0, 0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_time[1] = time.process_time()
        else:
            gc_time[0] += time.process_time() - gc_time[1]

    gc.callbacks.append(on_gc)
    timed = time_functions([s for s in os.environ.get("GPUHIT_TIME_FN", "").split(",") if s])
    trace = arrival = None
    for item in args.runs:
        label, rate = item.rsplit(":", 1)
        argv = ["replay", "--trace", args.trace, "--block-size", str(args.block_size), "--arrival", "poisson",
                "--policies", args.policies, "--session-rate", rate, "--num-seeds", "1", "--no-plots"]
        opts = _replay_parser().parse_args(argv)
        spec = next((s for s in plan_runs(opts) if s.label == label and s.seed == args.seed), None)
        if spec is None:
            ap.error(f"no policy labelled {label!r} in {args.policies}")
        if trace is None:
            trace = load_replay_trace(opts)
        arrival = arrival_options(opts, trace)
        for slot in timed.values():
            slot[0], slot[1] = 0.0, 0
        gc_time[0] = 0.0
        t0 = time.process_time()
        res = simulate(trace, spec.policy, instances=opts.instances, seed=spec.seed, roles=spec.roles,
                       index=opts.index, progress=False, label=spec.label, block_size=args.block_size,
                       synth=synth_for(spec.seed, args.block_size),
                       engine_kwargs={"block_size": args.block_size}, **arrival)
        cpu = time.process_time() - t0
        print(json.dumps({"code": args.code, "run": item, "cpu_s": round(cpu, 2), "records": len(res.records),
                          "digest": digest(res.records), "load": round(os.getloadavg()[0], 1),
                          "gc_s": round(gc_time[0], 2),
                          "functions": {k: [round(v[0], 3), v[1]] for k, v in timed.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
