"""GPU-hit-first routing that prices HBM residency: ``lpwl_resident`` (and its priority form).

Why LPWL loses (``analysis/lost_hits.py``; the case study in README "Results so far"): LPWL ranks on
queued prefill alone, so a warm session sticks to its holder whatever else lives there. Two
long-context sessions bound to one instance whose contexts together exceed its KV pool evict each
other's prefix on every turn (during the other's think time, or while queued behind it): LPWL still
predicts the hit the KV index shows at decision time, sends the turn back, and the engine recomputes
tens of thousands of tokens. Cold sessions are placed on the least *queued* instance, blind to the
KV the sessions already there will need at their next turn.

``lpwl_resident`` keeps LPWL's score and adds what a placement does to the instance's working set.
For each healthy instance ``i``, with ``need`` = this request's blocks after the turn
(``ceil((input + output) / block_size)``), ``R_i`` = the blocks of the other live sessions bound
there (:attr:`InstanceState.resident_blocks`: in flight, or idle for less than the observed p90
think gap) and ``C_i`` = its KV capacity in blocks (engine-reported, vLLM's ``num_gpu_blocks``):

    overflow_i = max(0, R_i + need - C_i)               blocks that cannot all stay resident
    lost_i     = min(gpu_hit_blocks_i, overflow_i)       of this request's hit, what the others evict
    work_i     = pending_prefill_i + (input - hit_i) + block_size * (lost_i + overflow_i)

and routes to ``argmin work_i`` (ties: :func:`~policies.common.tie_key`). Without overflow it is
LPWL exactly. With overflow, each turn of the session pair recomputes about ``overflow`` blocks
twice (its own evicted hit, then the victim's on its next turn), so staying is charged both, which
a one-time move to a roomy instance beats when the recurring loss exceeds the cold prefill. No
parameters: capacity comes from the engine, the live window from the traffic. An instance whose
capacity is unknown (before its first metrics scrape) is priced as LPWL prices it; the decision's
reason says so.

``priority`` (param, default ``none``): ``session_start`` also sets vLLM's per-request
``priority`` to the session's start time in milliseconds (program-level FCFS, as Continuum,
arXiv 2511.02230, schedules agent programs): under ``--scheduling-policy priority`` a continuation
turn of an older session runs before the first turns of newer ones. The engines must run with
priority scheduling (the simulator sets it when the policy asks; a live vLLM needs the flag, and
ignores the priority otherwise, without an error; ``gpuhit serve`` refuses engines it knows run FCFS).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.common import Param, healthy, new_prefill_tokens, parse_params, tie_key
from policies.registry import register
from policies.snapshot import FORWARD, Decision, InstanceState, Snapshot

PRIORITIES = ("none", "session_start")


def residency_work(snapshot: Snapshot, s: InstanceState) -> tuple[int, int, int]:
    """``(work, overflow, lost)`` of placing this request on ``s`` (see the module docstring)."""
    req = snapshot.request
    bs = req.block_size
    base = s.pending_prefill_tokens + new_prefill_tokens(snapshot, s)
    cap = s.capacity_blocks
    if cap is None:
        return base, 0, 0
    need = -(-(req.input_tokens + req.output_tokens) // bs)
    overflow = max(0, s.resident_blocks + need - cap)
    lost = min(s.gpu_hit_blocks, overflow)
    return base + bs * (lost + overflow), overflow, lost


def session_priority(snapshot: Snapshot) -> int:
    """Program-level FCFS: the session's start (first seen by the gateway) in integer milliseconds."""
    t = snapshot.session_started_at
    return round(1000.0 * (snapshot.now if t is None else t))


@dataclass(frozen=True, slots=True)
class LPWLResident:
    name: str = "lpwl_resident"
    type: str = "lpwl_resident"
    priority: str = "none"
    reads_residency = True  # the router fills InstanceState.resident_blocks

    @property
    def scheduling_policy(self) -> str:
        """The vLLM ``--scheduling-policy`` the engines need for this policy's decisions."""
        return "fcfs" if self.priority == "none" else "priority"

    def decide(self, snapshot: Snapshot) -> Decision:
        keyed = []
        for s in healthy(snapshot):
            work, overflow, lost = residency_work(snapshot, s)
            keyed.append((work, tie_key(s), s.index, overflow, lost))
        work, _, target, overflow, lost = min(keyed)
        inst = snapshot.instances[target]
        cap = "capacity unknown: priced as lpwl" if inst.capacity_blocks is None else (
            f"resident {inst.resident_blocks} + need of {inst.capacity_blocks} blocks: overflow {overflow}, "
            f"hit lost {lost}")
        prio = None if self.priority == "none" else session_priority(snapshot)
        return Decision(
            FORWARD, target,
            f"{self.name}: pending {inst.pending_prefill_tokens} + new {new_prefill_tokens(snapshot, inst)} "
            f"(hit {inst.gpu_hit_blocks} blocks); {cap}; work {work} is the least",
            scores=tuple((i, float(w)) for w, _, i, _, _ in keyed),
            predicted_hit_blocks=inst.gpu_hit_blocks, priority=prio,
        )


@register("lpwl_resident")
def _lpwl_resident(name: str, params: Mapping[str, Any]) -> LPWLResident:
    p = parse_params(
        "lpwl_resident", params,
        {"priority": Param("str", "none", lambda v: v in PRIORITIES, " | ".join(PRIORITIES))},
    )
    return LPWLResident(name=name, **p)


@register("lpwl_resident_prio")
def _lpwl_resident_prio(name: str, params: Mapping[str, Any]) -> LPWLResident:
    """``lpwl_resident`` with ``priority: session_start`` (its own name, so a comparison can name it)."""
    parse_params("lpwl_resident_prio", params, {})
    return LPWLResident(name=name, type="lpwl_resident_prio", priority="session_start")
