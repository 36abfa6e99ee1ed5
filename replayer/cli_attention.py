"""``gpuhit attention ...``: the route/fetch/local predicate from the command line.

``gpuhit attention choose --fabric h100_ibgda --mq 256 --ct 2048 [--measurements FILE]`` prints the
three predicted costs and the choice; with ``--measurements`` (a JSON written by
tests/perf/gpu_measure.py) the holder-compute, merge, splice and re-prefill constants come from that
measurement instead of the defaults from *Move the Query, Not the Cache* (README "References").
"""

from __future__ import annotations

import argparse
import json
import pathlib

from gpuhit.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("attention", help="route-the-query attention: cost predicate")
    sub = p.add_subparsers(dest="attention_command", metavar="ACTION")
    c = sub.add_parser("choose", help="route / fetch / local for one chunk")
    c.add_argument("--fabric", default="h100_ibgda")
    c.add_argument("--mq", type=int, required=True, help="query rows routed")
    c.add_argument("--ct", type=int, required=True, help="chunk tokens")
    c.add_argument("--measurements", default=None, help="gpu_measure JSON with measured constants")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_choose)


def _constants(path: str | None) -> dict[str, float]:
    if path is None:
        return {}
    try:
        res = json.loads(pathlib.Path(path).read_text())
        consts = res["crossover"]["used"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path}: not a gpu_measure result with a crossover section ({exc})") from exc
    return {k: float(v) for k, v in consts.items()}


def _choose(args: argparse.Namespace) -> int:
    from policies import costmodel as cm

    fab = cm.get_fabric(args.fabric)
    kw = _constants(args.measurements)
    ch = cm.choose_primitive(fab, mq=args.mq, ct=args.ct, **kw)
    row = {"fabric": fab.name, "mq": args.mq, "ct": args.ct, "choice": ch.primitive,
           "route_us": round(ch.route_s * 1e6, 2), "fetch_us": round(ch.fetch_s * 1e6, 2),
           "local_us": round(ch.local_s * 1e6, 2), "constants": kw}
    if args.json:
        print(json.dumps(row))
    else:
        print(f"{row['choice']}: route {row['route_us']} us, fetch {row['fetch_us']} us, local {row['local_us']} us "
              f"({fab.name}, Mq={args.mq}, ct={args.ct})")
    return 0
