"""Where a request's real-minus-simulated latency was spent: on the path or in the engine, and where there.

Both sides of ``gpuhit experiment sim-vs-real`` can carry the engine's own timing of each request
(live: vLLM's per-request span, :mod:`replayer.engine_spans`; simulated: the emulator's timestamps,
:class:`replayer.sim_target.SimTarget`). With it a request's client latency (send to finish) is the
sum of six parts, on each side alike:

* ``path_before``: send to the engine's arrival (replayer, gateway, HTTP on the way in);
* ``engine_other``: the engine's e2e less queue, prefill and decode (its API server taking the
  request in and handing the answer out, the hand-offs to its engine loop);
* ``queue``: waiting for the scheduler; ``prefill``: first scheduled to first token; ``decode``:
  first to last token (the engine's own figures, span attributes as vLLM names them);
* ``path_after``: the engine's end to the client's finish (the answer's way back).

vLLM stamps a request queued when its engine loop takes it in, between two steps, so a wait for the
step under way lands in ``engine_other``, not ``queue``; the emulator stamps it on arrival, so there
that wait is ``queue``: compare the two parts' sum where they differ in opposite directions. With
chunked prefill vLLM schedules nearly every request in the step after it arrives, and the wait
behind other requests' prefill shows in ``prefill``.

Every request is paired with itself on the other side (same seed, session and turn). Per group of
requests (those whose prefix hit is the same on both sides, to a block; and all) the real-minus-
simulated difference of each part, its mean, and the share of the summed latency gap it carries
(the shares add up to 100%); the same over the 10% of requests furthest apart, where the stalls are.
A part that carries the gap names what the model misses: the path (the live-path model), queueing,
prefill or decode step time, or the engine's frontend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpuhit.errors import ConfigError
from replayer.records import answered_by_turn

PARTS = ("path_before", "engine_other", "queue", "prefill", "decode", "path_after")
# the part of the model each part of the split holds against the live side
MODEL_PART = {
    "path_before": "the live path in (the live-path model)",
    "engine_other": "the engine's frontend (the profile's frontend delay)",
    "queue": "scheduler queueing",
    "prefill": "prefill (step time; with chunked prefill also waiting behind other chunks)",
    "decode": "decode step time",
    "path_after": "the live path back (the live-path model)",
}
TAIL_SHARE = 0.10  # the requests furthest apart: this share of the paired requests, by absolute gap


def has_engine_columns(df: Any) -> bool:
    """Whether a records frame carries the engine's timing (the columns of EngineTimedRecord)."""
    return "engine_e2e" in df.columns


def request_parts(df: Any) -> Any:
    """Per answered request with engine timing: its latency and its six parts (seconds), indexed by
    ``session#turn``. The parts sum to the latency by construction."""
    ok = answered_by_turn(df)
    ok = ok[ok["engine_e2e"].notna() & ok["engine_arrival"].notna()]
    latency = ok["finish"] - ok["arrival"]
    engine_end = ok["engine_arrival"] + ok["engine_e2e"]
    out = {
        "latency": latency,
        "path_before": ok["engine_arrival"] - ok["arrival"],
        "engine_other": ok["engine_e2e"] - ok["engine_queue"] - ok["engine_prefill"] - ok["engine_decode"],
        "queue": ok["engine_queue"],
        "prefill": ok["engine_prefill"],
        "decode": ok["engine_decode"],
        "path_after": ok["finish"] - engine_end,
        "hit": ok["realized_hit_tokens"],
    }
    import pandas as pd

    return pd.DataFrame(out)


def before_share(frames: Sequence[Any]) -> dict[str, float]:
    """Where the live path lies, from records with engine timing (live runs joined to their spans):
    ``{"before_share": mean path_before / (mean path_before + mean path_after), "path_before_s",
    "path_after_s", "n"}`` over every answered request of ``frames`` (what ``--live-path split``
    places on the way in; :func:`replayer.live_path.path_models`)."""
    import pandas as pd

    parts = pd.concat([request_parts(f) for f in frames]) if frames else pd.DataFrame()
    if not len(parts):
        raise ConfigError("no answered request with engine timing to split the path by")
    b, a = float(parts["path_before"].mean()), float(parts["path_after"].mean())
    return {"before_share": b / (a + b) if a + b > 0 else math.nan, "path_before_s": b, "path_after_s": a,
            "n": len(parts)}


def paired_parts(real: Any, sim: Any, block_size: int) -> Any:
    """One row per request answered with engine timing on both sides: ``gap`` (real - sim latency),
    each part's real - sim difference, and ``same_hit`` (the prefix hits differ by less than a block)."""
    r, s = request_parts(real), request_parts(sim)
    both = r.merge(s, how="inner", left_index=True, right_index=True, suffixes=("_r", "_s"))
    out = both[[]].copy()
    out["gap"] = both["latency_r"] - both["latency_s"]
    for p in PARTS:
        out[p] = both[f"{p}_r"] - both[f"{p}_s"]
        out[f"{p}_real"] = both[f"{p}_r"]
    out["same_hit"] = (both["hit_r"] - both["hit_s"]).abs() < block_size
    return out


def _group(pairs: Any) -> dict[str, Any]:
    """Mean gap and, per part, the mean real - sim difference, its share of the summed gap and each
    side's mean (seconds)."""
    n = len(pairs)
    if n == 0:
        return {"n": 0}
    total = float(pairs["gap"].sum())
    doc: dict[str, Any] = {"n": n, "gap_mean_s": total / n, "parts": {}}
    for p in PARTS:
        d = float(pairs[p].sum())
        real = float(pairs[f"{p}_real"].mean())
        doc["parts"][p] = {"mean_s": d / n, "share": d / total if total else math.nan, "real_mean_s": real,
                           "sim_mean_s": real - d / n}
    return doc


def split(pairs: Any) -> dict[str, Any]:
    """The split of one set of paired requests: ``{"same_hit", "all"}``, each with its ``tail`` (the
    :data:`TAIL_SHARE` of its requests furthest apart) beside it, and the largest part of each."""
    doc: dict[str, Any] = {}
    for name, grp in (("same_hit", pairs[pairs["same_hit"]]), ("all", pairs)):
        k = max(1, int(len(grp) * TAIL_SHARE))  # as sim-vs-real's tail share of the absolute gap
        tail = grp.iloc[np.argsort(-np.abs(grp["gap"].to_numpy()), kind="stable")[:k]]
        doc[name] = {**_group(grp), "tail": _group(tail)}
    return doc


def largest_part(group: Mapping[str, Any]) -> str:
    """The part that carries the most of a group's summed gap (by share; '' when none)."""
    parts = group.get("parts") or {}
    known = {p: v["share"] for p, v in parts.items() if not math.isnan(v["share"])}
    return max(known, key=known.__getitem__) if known else ""


def split_by_policy(pairs_by_policy: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """Per policy (its runs' paired requests pooled over seeds) and over all policies: :func:`split`."""
    import pandas as pd

    doc: dict[str, Any] = {}
    pooled = []
    for pol, frames in pairs_by_policy.items():
        frames = [f for f in frames if len(f)]
        if not frames:
            continue
        both = pd.concat(frames)
        pooled.append(both)
        doc[pol] = split(both)
    if len(pooled) > 1:
        doc["all policies"] = split(pd.concat(pooled))
    return doc


def _cell(group: Mapping[str, Any], part: str) -> str:
    v = group["parts"][part]
    share = "" if math.isnan(v["share"]) else f" ({v['share'] * 100:.0f}%)"
    return f"{v['mean_s'] * 1e3:+.1f}{share}"


def format_split(doc: Mapping[str, Any]) -> str:
    """Markdown: one row per policy and group (same hit, all; each with its tail), the mean real -
    sim difference of every part in ms and its share of the summed gap."""
    head = ("| policy | requests | gap mean ms | " + " | ".join(PARTS) + " | largest |")
    lines = ["Real - simulated per request, ms (share of the summed gap); parts: " + ", ".join(PARTS) + ".",
             "", head, "|" + "---|" * (len(PARTS) + 4)]
    for pol, sides in doc.items():
        for gname, label in (("same_hit", "same hit"), ("all", "all")):
            g = sides[gname]
            for sub, tag in ((g, ""), (g.get("tail", {}), f", furthest {TAIL_SHARE * 100:.0f}%")):
                if not sub.get("n"):
                    continue
                lines.append(f"| {pol}: {label}{tag} | {sub['n']} | {sub['gap_mean_s'] * 1e3:+.1f} | "
                             + " | ".join(_cell(sub, p) for p in PARTS) + f" | {largest_part(sub)} |")
    lines.append("")
    for pol, sides in doc.items():
        typical, tail = sides["same_hit"], sides["same_hit"].get("tail", {})
        if typical.get("n") and largest_part(typical) and tail.get("n") and largest_part(tail):
            lines.append(f"- {pol}: requests with the same hit, {typical['gap_mean_s'] * 1e3:+.0f} ms on average, most "
                         f"of it in {MODEL_PART[largest_part(typical)]} "
                         f"({typical['parts'][largest_part(typical)]['share'] * 100:.0f}%); the 10% furthest apart "
                         f"({tail['gap_mean_s'] * 1e3:+.0f} ms) in {MODEL_PART[largest_part(tail)]} "
                         f"({tail['parts'][largest_part(tail)]['share'] * 100:.0f}%)")
    lines += ["", "Mean per part, real / simulated ms (all requests): " + "; ".join(
        f"{pol} " + ", ".join(f"{p} {sides['all']['parts'][p]['real_mean_s'] * 1e3:.1f} / "
                              f"{sides['all']['parts'][p]['sim_mean_s'] * 1e3:.1f}" for p in PARTS)
        for pol, sides in doc.items() if sides["all"].get("n"))]
    return "\n".join(lines)


def parts_sum_to_gap(pairs: Any, atol: float = 1e-6) -> bool:
    """Whether every request's parts add up to its gap (they do by construction, up to float round-off
    of clock values: a check for reports and tests)."""
    total = np.sum([pairs[p].to_numpy() for p in PARTS], axis=0) if len(pairs) else np.zeros(0)
    return bool(np.allclose(total, pairs["gap"].to_numpy(), rtol=0.0, atol=atol))
