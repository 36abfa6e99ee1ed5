"""``gpuhit experiment tiers|knee``: the published calibration experiments on the emulated engine (and
``ab``, the A/B protocol, registered from :mod:`replayer.experiment_ab`); ``gpuhit emulate-check``: the
emulator against vLLM's own scheduler, step by step."""

from __future__ import annotations

import argparse
import json

from engines.emulated import experiments
from engines.emulated.profile import available_profiles, load_profile


def _tiers(args: argparse.Namespace) -> int:
    res = experiments.run_tiers(load_profile(args.profile))
    print(json.dumps(res, indent=2) if args.json else experiments.format_tiers(res))
    return 0


def _knee(args: argparse.Namespace) -> int:
    caps = tuple(args.capacities) if args.capacities else experiments.KNEE_CAPACITIES_GB
    res = experiments.run_knee(load_profile(args.profile), caps)
    print(json.dumps(res, indent=2) if args.json else experiments.format_knee(res))
    return 0


def _check(args: argparse.Namespace) -> int:
    from engines.emulated.vllm_check import run, workload

    configs = args.configs.split(",") if args.configs else list(workload.CONFIGS)
    streams = run.main_streams(configs, args.streams, args.seed)
    res = run.check(streams, args.vllm_python or run.require_python(), args.modes.split(","))
    if args.json:
        print(json.dumps({k: {"streams": r.streams, "steps": r.steps, "records": r.boundaries,
                              "unaligned": r.unaligned, "mismatching_streams": r.mismatching_streams,
                              "first_report": r.first_report} for k, r in res.items()}, indent=2))
    else:
        print(run.format_results(res))
    return 1 if any(r.mismatching_streams for r in res.values()) else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    c = subparsers.add_parser(
        "emulate-check",
        help="run generated request streams through vLLM's own Scheduler and the emulator; exit 1 on any mismatch",
        description="Differential check of the emulated engine against vLLM's real Scheduler + KVCacheManager "
                    "(run in the vLLM venv, no model): every step's batch, preemptions, computed tokens, blocks, "
                    "free queue, KV events and prefix-cache counters must agree. Needs the vLLM venv "
                    "($GPUHIT_VLLM_PYTHON or .venv-vllm).")
    c.add_argument("--streams", type=int, default=50, help="generated streams per configuration (default 50)")
    c.add_argument("--seed", type=int, default=0, help="first stream seed (default 0)")
    c.add_argument("--configs", default="", help="comma-separated configurations (default: all)")
    c.add_argument("--modes", default="step,jump",
                   help="emulator drivers: step (scheduler stepped), loop (engine loop, no jump), jump "
                        "(engine loop with the decode jump); default step,jump")
    c.add_argument("--vllm-python", default=None, help="the vLLM venv's python (default: found as the tests do)")
    c.add_argument("--json", action="store_true", help="print one JSON document")
    c.set_defaults(func=_check)

    exp = subparsers.add_parser("experiment", help="replay the published calibration experiments (virtual time)")
    sub = exp.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    profiles = ", ".join(available_profiles())
    t = sub.add_parser("tiers", help="TTFT per KV tier (miss / remote / CPU / GPU) at 8k-64k reused prefix")
    k = sub.add_parser("knee", help="APC and TTFT p90 of 4 closed-loop sessions vs GPU KV capacity")
    for p in (t, k):
        p.add_argument("--profile", default=experiments.DEFAULT_PROFILE,
                       help=f"engine profile name ({profiles}) or a .json profile file")
        p.add_argument("--json", action="store_true", help="print one JSON document")
    k.add_argument("--capacities", type=float, nargs="+", metavar="GB",
                   help="GPU KV capacities to sweep, in GB (default: %(default)s)")
    t.set_defaults(func=_tiers)
    k.set_defaults(func=_knee)
    from replayer import experiment_ab

    experiment_ab.register(sub)  # gpuhit experiment ab: the A/B protocol
    from replayer import ab_live, sim_vs_real

    ab_live.register(sub)  # gpuhit experiment ab-live: the same protocol on live engines
    sim_vs_real.register(sub)  # gpuhit experiment sim-vs-real: a live experiment replayed in simulation
