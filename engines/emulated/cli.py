"""``gpuhit experiment tiers|knee``: the seeds' calibration experiments on the emulated engine (and
``ab``, the A/B protocol, registered from :mod:`analysis.experiment_ab`)."""

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


def register(subparsers: argparse._SubParsersAction) -> None:
    exp = subparsers.add_parser("experiment", help="replay the seeds' calibration experiments (virtual time)")
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
    from analysis import experiment_ab

    experiment_ab.register(sub)  # gpuhit experiment ab: the A/B protocol (analysis/experiment_ab.py)
