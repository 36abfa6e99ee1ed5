"""GPU-hit-first routing: lpwl (least prefill work) and lpwl_migrate (LPWL plus session migration).

LPWL routes to ``argmin pending_prefill + (input - hit)``: a cold session (hit 0 everywhere) goes to
the least-loaded instance, a warm one (input - hit ~ a few hundred tokens on its holder) sticks,
with no parameter. Ties: :func:`~policies.common.tie_key` (fewer in-flight, fewer routed so far,
lower index).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.snapshot import FORWARD, MIGRATE, Decision, Snapshot
from policies.common import Param, healthy, new_prefill_tokens, parse_params, tie_key
from policies.registry import register


def lpwl_choice(snapshot: Snapshot) -> tuple[int, tuple[tuple[int, float], ...]]:
    """LPWL's target and every healthy candidate's prefill work (pending + input - hit)."""
    cands = healthy(snapshot)
    keyed = [
        (s.pending_prefill_tokens + new_prefill_tokens(snapshot, s), tie_key(s), s.index) for s in cands
    ]
    target = min(keyed)[2]
    return target, tuple((i, float(w)) for w, _, i in keyed)


@dataclass(frozen=True, slots=True)
class LPWL:
    name: str = "lpwl"
    type: str = "lpwl"

    def decide(self, snapshot: Snapshot) -> Decision:
        target, scores = lpwl_choice(snapshot)
        inst = snapshot.instances[target]
        return Decision(
            FORWARD, target,
            f"lpwl: pending {inst.pending_prefill_tokens} + new {new_prefill_tokens(snapshot, inst)} is the "
            f"least prefill work (hit {inst.gpu_hit_blocks} blocks)",
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
    """

    name: str = "lpwl_migrate"
    type: str = "lpwl_migrate"
    t_hot_tokens: int = 32768
    t_cool_s: float = 30.0
    min_gain_tokens: int = 0

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
                    gain = host.pending_prefill_tokens - dest.pending_prefill_tokens
                    if gain > 0 and gain >= self.min_gain_tokens:
                        return Decision(
                            MIGRATE, dest.index,
                            f"lpwl_migrate: host {h} hot (pending {host.pending_prefill_tokens} > "
                            f"{self.t_hot_tokens}), session cool; move {host.gpu_hit_blocks} blocks to "
                            f"instance {dest.index} (pending {dest.pending_prefill_tokens})",
                            source=h, scores=scores,
                            predicted_hit_blocks=max(host.gpu_hit_blocks, dest.gpu_hit_blocks),
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


@register("lpwl_migrate")
def _lpwl_migrate(name: str, params: Mapping[str, Any]) -> LPWLMigrate:
    p = parse_params(
        "lpwl_migrate",
        params,
        {
            "t_hot_tokens": Param("int", 32768, lambda v: v >= 0, ">= 0 tokens"),
            "t_cool_s": Param("float", 30.0, lambda v: v >= 0, ">= 0 seconds"),
            "min_gain_tokens": Param("int", 0, lambda v: v >= 0, ">= 0 tokens"),
        },
    )
    return LPWLMigrate(name=name, **p)
