"""What a replay's command-line options mean, shared by every command that replays a trace.

``gpuhit replay`` (simulated, :mod:`replayer.cli_replay`; live, :mod:`replayer.cli_replay_live`),
``gpuhit sweep`` (:mod:`replayer.cli_sweep`) and ``gpuhit experiment ab``
(:mod:`replayer.experiment_ab`) read the same options the same way: the trace to load, the seeds to
run and how sessions arrive. Kept apart from the commands so that each imports it, and none imports
another command's private helpers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpuhit.errors import ConfigError

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
