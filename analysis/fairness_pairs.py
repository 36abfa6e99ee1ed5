"""Which requests one policy loses against another, request by request (``python -m analysis.fairness_pairs``).

Two policies replayed on the same seeds see the same arrivals, so every request (session, turn,
seed) has a twin in the other run: the paired difference per request says *who* pays for a gap in a
percentile. The view splits it by prompt length (the bins of :data:`INPUT_BINS`) and by first turn
against later turns, and describes each policy's TTFT tail (the requests at or above their run's
TTFT p90): how long they were, how many were first turns, how long they waited before their own
prefill began, and how much prefill was queued on the instance they were sent to.

"Own prefill" is the prefill profile's time for the request's new tokens after its realized hit
(:class:`engines.emulated.profile.Profile`, the run's profile), so ``wait = TTFT - own prefill`` is
the time spent behind other work. The queued prefill at placement is read from the decision's
reason (``pending N``), which every cache-aware policy writes.
"""

from __future__ import annotations

import argparse
import pathlib
import re
from typing import Any

from gpuhit.errors import ConfigError

INPUT_BINS = (0, 2_000, 8_000, 16_000, 32_000, 10**9)  # prompt tokens
_PENDING = re.compile(r"pending (\d+)")


def load(folder: pathlib.Path, policy: str, profile: Any) -> Any:
    """The ok records of ``policy`` over every seed in ``folder``, with ttft, latency, own prefill
    time, wait and queued prefill at placement."""
    import pandas as pd

    files = sorted((folder / "records").glob(f"{policy}-seed*.csv"))
    if not files:
        raise ConfigError(f"{folder}: no records of policy {policy!r}")
    d = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    d = d[d["error"].astype(object).fillna("").astype(str) == ""].copy()
    d["ttft"] = d["first_token"] - d["arrival"]
    d["latency"] = d["finish"] - d["arrival"]
    hit = d["realized_hit_tokens"].to_numpy(int)
    new = d["input_tokens"].to_numpy(int) - hit
    d["own_prefill"] = [profile.prefill_cost(int(n), int(c)) for n, c in zip(new, hit, strict=True)]
    d["wait"] = d["ttft"] - d["own_prefill"]
    d["queued_at_placement"] = d["reason"].astype(str).str.extract(_PENDING)[0].astype(float)
    return d


def tail(d: Any, column: str = "ttft", q: float = 90.0) -> Any:
    """The rows at or above their own run's ``q``-th percentile of ``column``."""
    import numpy as np

    thr = d.groupby("seed")[column].transform(lambda x: np.percentile(x, q))
    return d[d[column] >= thr]


def compare(folder: str | pathlib.Path, a: str, b: str, profile_name: str | None = None) -> str:
    """The module docstring's view as Markdown."""
    import pandas as pd

    from engines.emulated.profile import DEFAULT_PROFILE, load_profile

    folder = pathlib.Path(folder)
    profile = load_profile(profile_name or DEFAULT_PROFILE)
    da, db = load(folder, a, profile), load(folder, b, profile)
    m = da.merge(db, on=["seed", "session", "turn"], suffixes=("_a", "_b"))
    if m.empty:
        raise ConfigError(f"{folder}: {a} and {b} share no (seed, session, turn)")
    m["first turn"] = m["turn"] == 0
    m["prompt tokens"] = pd.cut(m["input_tokens_a"], list(INPUT_BINS))
    out = [f"### {a} against {b}, request by request ({len(m)} pairs over {m['seed'].nunique()} seeds)", ""]
    for key in ("first turn", "prompt tokens"):
        g = m.groupby(key, observed=True)
        out += [f"| {key} | requests | TTFT {a} s | TTFT {b} s | TTFT diff s | latency diff s |", "|---|---:|---:|---:|---:|---:|"]
        for k, x in g:
            out.append(f"| {k} | {len(x)} | {x['ttft_a'].mean():.2f} | {x['ttft_b'].mean():.2f} | "
                       f"{(x['ttft_a'] - x['ttft_b']).mean():+.2f} | {(x['latency_a'] - x['latency_b']).mean():+.2f} |")
        out.append("")
    out += ["TTFT tail (requests at or above their run's TTFT p90):", "",
            "| policy | requests | first turns % | prompt tokens | own prefill s | wait s | queued at placement (tokens) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name, d in ((a, da), (b, db)):
        t = tail(d)
        out.append(f"| {name} | {len(t)} | {100 * (t['turn'] == 0).mean():.0f} | {t['input_tokens'].mean():,.0f} | "
                   f"{t['own_prefill'].mean():.2f} | {t['wait'].mean():.2f} | {t['queued_at_placement'].mean():,.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.fairness_pairs", description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a gpuhit replay results folder holding both policies' records")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--profile", default=None, help="engine profile (default: the emulator's default)")
    args = p.parse_args(argv)
    print(compare(args.folder, args.a, args.b, args.profile))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
