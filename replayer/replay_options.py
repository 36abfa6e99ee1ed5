"""What a replay's command-line options mean, shared by every command that replays a trace.

``gpuhit replay`` (simulated, :mod:`replayer.cli_replay`; live, :mod:`replayer.cli_replay_live`),
``gpuhit sweep`` (:mod:`replayer.cli_sweep`) and ``gpuhit experiment ab``
(:mod:`replayer.experiment_ab`) read the same options the same way: the trace to load, the seeds to
run and how sessions arrive; :func:`add_replay_arguments` defines them. Kept apart from the commands
so that each imports it, and none imports another command's private helpers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from gpuhit.errors import ConfigError
from replayer.replicas import LB_MODES, SHARE_MODES

DEFAULT_SESSION_RATE = 1.0 / 60.0  # sessions per second (one new conversation a minute on average)
DEFAULT_MAX_THINK = 60.0  # seconds

# Seeds a comparison of several policies runs by default: paired intervals need n >= 2, and with
# fewer than 5 pairs a t interval is too wide to separate policies that differ by a few percent.
COMPARE_SEEDS = 5


def parse_seeds(args: argparse.Namespace, n_configs: int = 1) -> list[int]:
    """The seeds ``--seeds`` / ``--num-seeds`` name; by default 0..COMPARE_SEEDS-1 when several
    policy configurations are compared (a paired interval needs them), else just 0."""
    if args.num_seeds is not None:
        if args.num_seeds <= 0:
            raise ConfigError("--num-seeds must be positive")
        return list(range(args.num_seeds))
    if args.seeds is None:
        return list(range(COMPARE_SEEDS)) if n_configs > 1 else [0]
    try:
        seeds = [int(x) for x in str(args.seeds).split(",") if x.strip() != ""]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds repeats a seed: {args.seeds}")
    return seeds


def arrival_options(args: argparse.Namespace, trace: Any) -> dict[str, Any]:
    """How sessions arrive and think, as keyword options of the arrival and driver configs.

    With no ``--arrival``: a fixed population if ``--sessions-concurrent`` is given, Poisson if
    ``--session-rate`` is, else the trace's own start times when its root sessions spread in time
    (WEKA conversations all start at t=0: then Poisson at :data:`DEFAULT_SESSION_RATE`)."""
    from replayer.arrivals import roots

    mode = args.arrival
    if mode is None:
        if args.sessions_concurrent is not None:
            mode = "concurrent"
        elif args.session_rate is not None:
            mode = "poisson"
        else:
            starts = {s.arrival for s in roots(trace)}
            mode = "trace" if len(starts) > 1 else "poisson"
    rate = args.session_rate
    if mode == "poisson" and rate is None:
        rate = DEFAULT_SESSION_RATE
    mt = str(args.max_think).strip().lower()
    if mt in ("inf", "none", "off"):
        max_think = None
    else:
        try:
            max_think = float(mt)
        except ValueError:
            raise ConfigError(f"--max-think must be seconds or 'inf', got {args.max_think!r}") from None
        if not max_think >= 0:
            raise ConfigError("--max-think must be >= 0")
    return {"arrival": mode, "session_rate": rate if mode == "poisson" else None,
            "sessions_concurrent": args.sessions_concurrent if mode == "concurrent" else None,
            "time_scale": args.time_scale, "think_time_scale": args.think_scale, "max_think_time": max_think}


def load_replay_trace(args: argparse.Namespace) -> Any:
    """The trace ``--trace`` / ``--format`` name (default: the bundled WEKA slice); bad records are
    skipped with one warning line, a trace without sessions is refused."""
    from replayer.loaders import bundled_path, load_trace

    paths = args.trace or [bundled_path("weka")]
    res = load_trace(paths, fmt=args.format)
    if res.skipped:
        print(f"gpuhit replay: skipped {res.skipped} bad records; first: {res.problems[:3]}", file=sys.stderr)
    if not res.trace.sessions:
        raise ConfigError("the trace holds no sessions to replay")
    return res.trace


def add_replay_arguments(p: argparse.ArgumentParser, demo_policies: Sequence[str], instances: int) -> None:
    """Define ``gpuhit replay``'s options on ``p``; ``demo_policies`` is the set compared when none
    are named (its help names them), ``instances`` the default engine count. Kept here, beside what
    the options mean, so the command's module holds the planning and running only; ``gpuhit sweep``
    and ``experiment ab`` parse the same options through it."""
    p.add_argument("--trace", action="append", metavar="PATH", default=None,
                   help="trace file or folder (repeatable; default: the bundled WEKA slice)")
    p.add_argument("--format", default=None, help="force the trace format (default: detect)")
    p.add_argument("--policies", default=None, metavar="A,B,C|FILE",
                   help="comma-separated policy names, or a JSON/TOML file of {name, type, params} entries "
                        f"(default: {','.join(demo_policies)}; --all-policies: every registered one)")
    p.add_argument("--all-policies", action="store_true",
                   help="compare every registered policy (pd_disagg as an even P/D split) instead of the default set")
    p.add_argument("--reference", default=None, metavar="NAME",
                   help="the policy every paired difference is taken against (default: lpwl_auto when "
                        "compared without --policies, else the first policy)")
    p.add_argument("--full-table", action="store_true",
                   help="print every column with its legend, the per-instance routing and each run's timing "
                        "(default: the headline and a short table; the files always hold everything)")
    p.add_argument("--instances", type=int, default=instances,
                   help=f"emulated instances (default {instances})")
    p.add_argument("--profile", default=None, help="emulated engine profile (default qwen3-coder-30b-a3b@h20)")
    p.add_argument("--arrival", choices=("trace", "poisson", "concurrent"), default=None,
                   help="session starts: trace timestamps, Poisson at --session-rate, or a fixed "
                        "population --sessions-concurrent (default: trace if the trace spreads its "
                        "sessions in time, else poisson)")
    p.add_argument("--session-rate", type=float, default=None, metavar="R",
                   help=f"Poisson session arrivals per second (default {DEFAULT_SESSION_RATE:.4g})")
    p.add_argument("--sessions-concurrent", type=int, default=None, metavar="N",
                   help="fixed population of concurrent sessions")
    p.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="multiply trace arrival gaps and think times by X (default 1)")
    p.add_argument("--think-scale", type=float, default=None, metavar="X",
                   help="multiply think times by X (default: --time-scale)")
    p.add_argument("--max-think", default=str(DEFAULT_MAX_THINK), metavar="S",
                   help=f"cap each think time at S seconds ('inf' = no cap; default {DEFAULT_MAX_THINK:g})")
    seeds = p.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", default=None, metavar="0,1,2",
                       help=f"seeds to run (default: 0..{COMPARE_SEEDS - 1} when comparing several policies, "
                            "else 0)")
    seeds.add_argument("--num-seeds", type=int, default=None, metavar="K", help="run seeds 0..K-1")
    p.add_argument("--out", default=None, metavar="DIR", help="results folder (default results/<UTC timestamp>)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="finish an interrupted simulated replay in DIR with the options it was started with "
                        "(runs already saved there are kept, not redone; an unfinished run starts over)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("--open-loop", action="store_true", help="send turns at recorded offsets (comparison only)")
    p.add_argument("--max-requests", type=int, default=None, metavar="N", help="stop sending after N requests per run")
    p.add_argument("--max-sessions", type=int, default=None, metavar="N", help="replay only the first N root sessions")
    p.add_argument("--pd", action="append", default=[], metavar="6P+2D",
                   help="add a pd_disagg run with these prefill/decode pools (repeatable)")
    p.add_argument("--block-size", type=int, default=16, metavar="N",
                   help="KV block size of the emulated engines and the router (default 16, vLLM's; "
                        "larger is faster to simulate, coarser in prefix hits)")
    p.add_argument("--index", choices=("precise", "approximate"), default="precise",
                   help="router KV index: precise (KV events) or approximate (routing history)")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="parallel worker processes (default: min(2, CPU cores, runs))")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run each (policy, seed) as a Ray task: on the cluster at ADDRESS (ray://HOST:10001, "
                        "HOST:6379 or auto), or on a local Ray started for this replay when no ADDRESS is given "
                        "(needs the ray extra; records are identical to the local pool's)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots and the HTML report's images")
    p.add_argument("--progress", action="store_true", help="show the progress line even when stderr is not a TTY")
    p.add_argument("--gateway", default=None, metavar="URL",
                   help="live mode: replay against a running gpuhit gateway at URL instead of simulating")
    p.add_argument("--api", choices=("completions", "chat", "messages", "responses"), default="completions",
                   help="live mode: the API each turn is sent through: completions (token ids, the default), chat, "
                        "messages (Anthropic) or responses (OpenAI); the text APIs send the turns as a conversation")
    p.add_argument("--gpu-util", action="append", default=[], metavar="NAME=SPEC",
                   help="live mode: where engine NAME's GPU utilization comes from: busy:URL (the emulator's "
                        "busy-seconds counter at URL/metrics), dcgm:URL[#gpu=N] or nvml:N (needs the nvml extra); "
                        "default busy:URL for every engine the gateway's /debug/state lists")
    p.add_argument("--util-interval", type=float, default=1.0, metavar="S",
                   help="live mode: seconds between GPU utilization samples (default 1)")
    # -- simulated gateway replicas (replayer/replicas.py)
    p.add_argument("--gateway-replicas", type=int, default=1, metavar="K",
                   help="simulate K gateway replicas, each with its own counters and bindings (default 1)")
    p.add_argument("--share", choices=SHARE_MODES, default="none",
                   help="what the replicas share besides the KV index: none, or decisions (counters and bindings, "
                        "as gpuhit serve --share redis://...)")
    p.add_argument("--share-delay", type=float, default=0.0, metavar="S",
                   help="with --share decisions: seconds a replica's change takes to reach the others (default 0)")
    p.add_argument("--replica-lb", choices=LB_MODES, default="sticky",
                   help="how requests reach replicas: sticky (a session stays on one, by hash) or random (per request)")
