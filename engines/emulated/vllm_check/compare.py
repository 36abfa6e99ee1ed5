"""Line up per-step records of both sides and report the first mismatch."""

from __future__ import annotations

import json
from typing import Any

#: compared fields, in the order a mismatch is reported
FIELDS = ("sched", "preempted", "finished", "computed", "blocks", "events", "free", "free_queue",
          "stats", "lookups")


def normalize_events(events: list[list]) -> list[list]:
    """One ``BlockRemoved`` per evicted hash (vLLM's form; the emulator groups an allocation's)."""
    out: list[list] = []
    for e in events:
        if e[0] == "R":
            out.extend(["R", [h]] for h in e[1])
        else:
            out.append(e)
    return out


def compare_stream(vllm: list[dict[str, Any]], emu: list[dict[str, Any]]) -> tuple[int, str | None]:
    """(steps that agree, None) or (index of the first differing step, report)."""
    for i, (a, b) in enumerate(zip(vllm, emu)):
        for f in FIELDS:
            x, y = a.get(f), b.get(f)
            if f == "events":
                x, y = normalize_events(x), normalize_events(y)
            if x != y:
                ctx = ""
                if i:
                    ctx = "previous step (vLLM): " + _short(vllm[i - 1]) + "\n"
                return i, (f"step {a['step']}: {f} differs\n  vLLM:     {_short_val(x)}\n  emulator: {_short_val(y)}\n"
                           f"{ctx}this step (vLLM):     {_short(a)}\nthis step (emulator): {_short(b)}")
    if len(vllm) != len(emu):
        n = min(len(vllm), len(emu))
        return n, f"vLLM ran {len(vllm)} steps, the emulator {len(emu)}"
    return len(vllm), None


def _short_val(v: Any, limit: int = 600) -> str:
    s = json.dumps(v)
    return s if len(s) <= limit else s[:limit] + " ..."


def _short(rec: dict[str, Any]) -> str:
    keep = {k: rec[k] for k in ("step", "sched", "preempted", "finished", "computed", "free")}
    return _short_val(keep, 1000)


STATE_FIELDS = ("computed", "blocks", "free", "free_queue", "stats")


def compare_boundaries(vllm: list[dict[str, Any]], emu: list[dict[str, Any]]) -> tuple[int, str | None]:
    """Compare the engine's step-loop records (one per step boundary it exposes; a decode jump
    merges ``merged`` steps into one) with vLLM's per-step records: the state at each boundary,
    the events and completions of the steps since the previous one, the batch of every step.
    Returns (vLLM steps covered, None) or (boundary index, report)."""
    prev = -1
    for i, rec in enumerate(emu):
        b, m = rec["step"], rec["merged"]
        if b >= len(vllm):
            return i, f"boundary at step {b} beyond vLLM's {len(vllm)} steps"
        v = vllm[b]
        span = vllm[prev + 1: b + 1]
        for f in STATE_FIELDS:
            if v[f] != rec[f]:
                return i, (f"boundary after step {b} (merged {m}): {f} differs\n  vLLM:     {_short_val(v[f])}\n"
                           f"  emulator: {_short_val(rec[f])}\nthis step (vLLM): {_short(v)}")
        ev_v = normalize_events([e for x in span for e in x["events"]])
        if ev_v != normalize_events(rec["events"]):
            return i, (f"boundary after step {b} (merged {m}): events of steps {prev + 1}..{b} differ\n"
                       f"  vLLM:     {_short_val(ev_v)}\n  emulator: {_short_val(normalize_events(rec['events']))}")
        fin_v = sorted(r for x in span for r in x["finished"])
        if fin_v != rec["finished"]:
            return i, f"boundary after step {b}: finished differ: vLLM {fin_v}, emulator {rec['finished']}"
        for x in vllm[b - m + 1: b + 1]:
            if x["sched"] != rec["sched"] or (m == 1 and x["preempted"] != rec["preempted"]):
                return i, (f"step {x['step']} (boundary {b}, merged {m}): batch differs\n  vLLM:     "
                           f"{_short_val([x['sched'], x['preempted']])}\n  emulator: "
                           f"{_short_val([rec['sched'], rec['preempted']])}")
        for x in vllm[prev + 1: b - m + 1]:  # steps the engine did not take: vLLM idled too
            if x["sched"]:
                return i, f"step {x['step']}: vLLM scheduled {x['sched']}, the engine took no step"
        prev = b
    if emu and vllm[-1]["stats"] != emu[-1]["stats"]:
        return len(emu), f"final prefix-cache counters differ: vLLM {vllm[-1]['stats']}, emulator {emu[-1]['stats']}"
    for x in vllm[prev + 1:]:
        if x["sched"]:
            return len(emu), f"step {x['step']}: vLLM scheduled {x['sched']} after the engine's last step"
    return prev + 1, None
