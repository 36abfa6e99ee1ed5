"""GPU-hit-first routing: lpwl (least prefill work) and lpwl_migrate (LPWL plus session migration).

LPWL routes to ``argmin pending_prefill + (input - hit)``: a cold session (hit 0 everywhere) goes to
the least-loaded instance, a warm one (input - hit ~ a few hundred tokens on its holder) sticks,
with no parameter. Ties: :func:`~policies.common.tie_key` (fewer in-flight, fewer routed so far,
lower index).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from engines.base import max_cached_tokens
from policies.common import Param, healthy, new_prefill_tokens, parse_params, tie_key
from policies.registry import register
from policies.snapshot import FORWARD, MIGRATE, Decision, InstanceState, Snapshot

# vLLM priority of a migration's KV export under --scheduling-policy priority: smaller runs first, and
# every other request keeps vLLM's default 0, so the export goes ahead of the host's whole backlog.
EXPORT_PRIORITY = -1

# Prefill-token equivalents per prompt token of moving a session's KV: 96 KiB/token (Qwen3-Coder-30B-A3B)
# over the ~9.7 GB/s NIC is ~10.1 us, against ~50 us of prefill per token (both from the *GPU-Hit-First*
# note, README "References").
SEED_EXPORT_TOKENS_PER_TOKEN = 98304 / 9.7e9 / 50e-6


def _least_work(snapshot: Snapshot) -> tuple[InstanceState, int, tuple[tuple[int, float], ...]]:
    """The LPWL target, its prefill work and every healthy candidate's (index, work).

    Work is ``pending + new_prefill_tokens`` and ties go by :func:`~policies.common.tie_key`; both
    are written out in the loop (the key is ``(work, *tie_key(s))``): this runs per instance per
    request, and the helper calls were half of the gateway's decision time."""
    req = snapshot.request
    n, bs = req.input_tokens, req.block_size
    cap = max_cached_tokens(n, bs)  # Snapshot.hit_tokens' cap, once
    best: tuple[int, int, int, int] | None = None
    scores = []
    for s in snapshot.instances:  # healthy(snapshot), without the list
        if not s.healthy:
            continue
        w = s.pending_prefill_tokens + n - min(s.gpu_hit_blocks * bs, cap)
        k = (w, s.in_flight, s.routed, s.index)
        if best is None or k < best:
            best = k
        scores.append((s.index, float(w)))
    if best is None:
        healthy(snapshot)  # raises its NoInstanceError
        raise AssertionError("unreachable")
    return snapshot.instances[best[3]], best[0], tuple(scores)


def lpwl_choice(snapshot: Snapshot) -> tuple[int, tuple[tuple[int, float], ...]]:
    """LPWL's target and every healthy candidate's prefill work (pending + input - hit)."""
    inst, _, scores = _least_work(snapshot)
    return inst.index, scores


@dataclass(frozen=True, slots=True)
class LPWL:
    name: str = "lpwl"
    type: str = "lpwl"
    reads_engine_stats: ClassVar[bool] = False  # see policies.registry.Policy

    def decide(self, snapshot: Snapshot) -> Decision:
        inst, work, scores = _least_work(snapshot)
        pending = inst.pending_prefill_tokens
        return Decision(
            FORWARD, inst.index,
            f"lpwl: pending {pending} + new {work - pending} is the least prefill work "
            f"(hit {inst.gpu_hit_blocks} blocks)",
            scores=scores, predicted_hit_blocks=inst.gpu_hit_blocks,
        )


@dataclass(frozen=True, slots=True)
class LPWLMigrate:
    """LPWL, plus migration of a hot host's session.

    Trigger: the session is bound to a healthy host ``h`` holding a GPU prefix of this request,
    ``pending_prefill(h) > t_hot_tokens``, and the session was not migrated within ``t_cool_s``
    seconds (``now - last_migrated_at``). Target: the healthy instance other than ``h`` with the
    fewest pending prefill tokens (ties: :func:`~policies.common.tie_key`), an observable rather than a
    cost-model prediction; it must have fewer pending tokens than ``h``. Action: MIGRATE from
    ``h`` (the router moves the session's KV, rebinds, runs the request there). Otherwise: LPWL.

    Defaults: ``t_hot_tokens`` 32768 (~1.6 s of queued prefill at 50 us/token), ``t_cool_s`` 30 s
    (several agentic turns: the inter-turn gap p50 is 1.6 s). Scores: LPWL's prefill work.

    ``min_gain_tokens`` (default 0: the rule above) also asks the destination to have at least that
    many fewer pending prefill tokens than the host. Why: under overload every host is "hot" and
    the fewest-pending destination is barely lighter, so the absolute trigger moves sessions (NIC
    time, and evictions of the destination's cache) for no queueing gain; on full ``weka_cc`` at
    0.008 sessions/s that made lpwl_migrate the worst colocated policy (``analysis/results``).

    The export (the producer step on the host) is an ordinary request there, so by default it queues
    behind the very backlog that triggered the move. ``export_priority`` sends it at vLLM priority
    :data:`EXPORT_PRIORITY` (engines under ``--scheduling-policy priority``), ahead of every
    default-priority request; ``export_tokens_per_token`` > 0 charges the move its cost
    (:meth:`export_cost_tokens`) against the queueing gain. ``lpwl_migrate_prio`` sets both.
    """

    name: str = "lpwl_migrate"
    type: str = "lpwl_migrate"
    t_hot_tokens: int = 32768
    t_cool_s: float = 30.0
    min_gain_tokens: int = 0
    export_priority: bool = False
    export_tokens_per_token: float = 0.0
    reads_engine_stats: ClassVar[bool] = False  # see policies.registry.Policy

    @property
    def scheduling_policy(self) -> str:
        """The vLLM ``--scheduling-policy`` the engines need: ``priority`` when the export jumps the queue."""
        return "priority" if self.export_priority else "fcfs"

    def export_cost_tokens(self, snapshot: Snapshot, host: InstanceState) -> float:
        """What the move costs, in prefill-token equivalents: the host computes the prompt's tail it
        does not hold, and the whole prompt's KV crosses the NIC (``export_tokens_per_token`` per
        prompt token; 0 = the old trigger, which booked the export as if it were free)."""
        tail = new_prefill_tokens(snapshot, host)
        return tail + self.export_tokens_per_token * snapshot.request.input_tokens

    def decide(self, snapshot: Snapshot) -> Decision:
        target, scores = lpwl_choice(snapshot)
        insts = snapshot.instances
        h = snapshot.binding
        if h is not None and insts[h].healthy and insts[h].gpu_hit_blocks > 0:
            host = insts[h]
            last = snapshot.last_migrated_at
            cooled = last is None or snapshot.now - last >= self.t_cool_s
            if host.pending_prefill_tokens > self.t_hot_tokens and cooled:
                others = [s for s in insts if s.healthy and s.index != h]
                if others:
                    dest = min(others, key=lambda s: (s.pending_prefill_tokens, *tie_key(s)))
                    gain = float(host.pending_prefill_tokens - dest.pending_prefill_tokens)
                    if self.export_tokens_per_token > 0:
                        gain -= self.export_cost_tokens(snapshot, host)
                    if gain > 0 and gain >= self.min_gain_tokens:
                        return Decision(
                            MIGRATE, dest.index,
                            f"lpwl_migrate: host {h} hot (pending {host.pending_prefill_tokens} > "
                            f"{self.t_hot_tokens}), session cool; move {host.gpu_hit_blocks} blocks to "
                            f"instance {dest.index} (pending {dest.pending_prefill_tokens})",
                            source=h, scores=scores,
                            predicted_hit_blocks=max(host.gpu_hit_blocks, dest.gpu_hit_blocks),
                            producer_priority=EXPORT_PRIORITY if self.export_priority else None,
                        )
        inst = insts[target]
        return Decision(
            FORWARD, target,
            f"lpwl_migrate: no migration; lpwl: pending {inst.pending_prefill_tokens} + new "
            f"{new_prefill_tokens(snapshot, inst)} is the least prefill work",
            scores=scores, predicted_hit_blocks=inst.gpu_hit_blocks,
        )


@register("lpwl")
def _lpwl(name: str, params: Mapping[str, Any]) -> LPWL:
    parse_params("lpwl", params, {})
    return LPWL(name=name)


# The trigger's params, shared by lpwl_migrate and lpwl_migrate_prio.
_TRIGGER_PARAMS = {
    "t_hot_tokens": Param("int", 32768, lambda v: v >= 0, ">= 0 tokens"),
    "t_cool_s": Param("float", 30.0, lambda v: v >= 0, ">= 0 seconds"),
    "min_gain_tokens": Param("int", 0, lambda v: v >= 0, ">= 0 tokens"),
}


@register("lpwl_migrate")
def _lpwl_migrate(name: str, params: Mapping[str, Any]) -> LPWLMigrate:
    p = parse_params(
        "lpwl_migrate",
        params,
        {
            **_TRIGGER_PARAMS,
            "export_priority": Param("bool", False),
            "export_tokens_per_token": Param("float", 0.0, lambda v: v >= 0, ">= 0"),
        },
    )
    return LPWLMigrate(name=name, **p)


@register("lpwl_migrate_prio")
def _lpwl_migrate_prio(name: str, params: Mapping[str, Any]) -> LPWLMigrate:
    """lpwl_migrate whose export runs at vLLM priority ahead of the host's backlog and whose trigger
    charges the export's cost (the *GPU-Hit-First* note's NIC and prefill rates); other params as lpwl_migrate's."""
    p = parse_params("lpwl_migrate_prio", params, _TRIGGER_PARAMS)
    return LPWLMigrate(name=name, type="lpwl_migrate_prio", export_priority=True,
                       export_tokens_per_token=SEED_EXPORT_TOKENS_PER_TOKEN, **p)
