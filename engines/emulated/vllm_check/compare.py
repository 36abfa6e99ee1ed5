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
