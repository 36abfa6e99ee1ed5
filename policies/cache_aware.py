"""Cache-aware baselines as production routers do them: lmetric, linear (and its Dynamo variant), unified.

Tie-breaks (deterministic): lmetric and linear-dynamo: lower score, then lower index; linear
(ratio): higher score, then lower index; unified: see :class:`Unified`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.snapshot import FORWARD, Decision, Snapshot
from policies.common import Param, fmt, healthy, new_prefill_tokens, parse_params
from policies.registry import register


@dataclass(frozen=True, slots=True)
class LMetric:
    """LMetric: ``argmin (pending_prefill + input - hit) x (batch + 1)``, batch = in-flight requests.

    The product dilutes cache affinity: an instance holding the whole prefix but already running a
    few requests loses to an idle cold instance, because its small prefill term is multiplied by its
    batch while the cold one's large term is multiplied by 1.
    """

    name: str = "lmetric"
    type: str = "lmetric"

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        scored = [
            (float((s.pending_prefill_tokens + new_prefill_tokens(snapshot, s)) * (s.in_flight + 1)), s.index)
            for s in cands
        ]
        score, target = min(scored)
        inst = snapshot.instances[target]
        return Decision(
            FORWARD, target,
            f"lmetric: (pending {inst.pending_prefill_tokens} + new {new_prefill_tokens(snapshot, inst)}) x "
            f"(batch {inst.in_flight} + 1) = {fmt(score)} is the lowest",
            scores=tuple((i, sc) for sc, i in scored), predicted_hit_blocks=inst.gpu_hit_blocks,
        )


@dataclass(frozen=True, slots=True)
class Linear:
    """Linear cache + load mix.

    ``variant="ratio"`` (vLLM production-stack / llm-d style): score = ``hit_ratio_weight x
    hit/input - load_weight x in_flight / max(in_flight over healthy)`` (0 load when all are idle),
    argmax.

    ``variant="dynamo"`` (NVIDIA Dynamo's KV router): cost = ``overlap_weight x prefill_blocks +
    decode_blocks`` with prefill_blocks = (pending prefill + input - hit) / block_size and
    decode_blocks = active blocks + this request's blocks (prompt + output), argmin.
    """

    name: str = "linear"
    type: str = "linear"
    variant: str = "ratio"
    hit_ratio_weight: float = 1.0
    load_weight: float = 1.0
    overlap_weight: float = 1.0

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        req = snapshot.request
        if self.variant == "dynamo":
            bs = req.block_size
            own_blocks = -(-(req.input_tokens + req.output_tokens) // bs)
            scored = []
            for s in cands:
                prefill_blocks = (s.pending_prefill_tokens + new_prefill_tokens(snapshot, s)) / bs
                decode_blocks = s.active_blocks + own_blocks
                scored.append((self.overlap_weight * prefill_blocks + decode_blocks, s.index))
            cost, target = min(scored)
            reason = f"linear/dynamo: overlap_weight x prefill_blocks + decode_blocks = {fmt(cost)} is the lowest"
            scores = tuple((i, c) for c, i in scored)
        else:
            max_load = max(s.in_flight for s in cands)
            scored = []
            for s in cands:
                ratio = snapshot.hit_tokens(s.index) / req.input_tokens
                load = s.in_flight / max_load if max_load else 0.0
                scored.append((-(self.hit_ratio_weight * ratio - self.load_weight * load), s.index))
            neg, target = min(scored)
            reason = f"linear: hit_ratio_weight x hit/input - load_weight x load = {fmt(-neg)} is the highest"
            scores = tuple((i, -n) for n, i in scored)
        return Decision(
            FORWARD, target, reason, scores=scores, predicted_hit_blocks=snapshot.instances[target].gpu_hit_blocks
        )


@dataclass(frozen=True, slots=True)
class Unified:
    """Sticky for warm sessions, load-aware for new ones.

    A session bound to a healthy instance stays there unless that instance's pending prefill exceeds
    ``pending_threshold_tokens`` (default 32768 tokens, ~1.6 s of queued prefill at the profile's
    50 us/token); then, and for new sessions, the request goes to the instance with the least
    pending prefill (ties: fewer in-flight, then lower index), ignoring the cache. Scores: pending
    prefill tokens of every candidate (lower is better).
    """

    name: str = "unified"
    type: str = "unified"
    pending_threshold_tokens: int = 32768

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        b = snapshot.binding
        insts = snapshot.instances
        scores = tuple((s.index, float(s.pending_prefill_tokens)) for s in cands)
        if b is not None and insts[b].healthy:
            if insts[b].pending_prefill_tokens <= self.pending_threshold_tokens:
                return Decision(
                    FORWARD, b,
                    f"unified: warm session stays on instance {b} (pending {insts[b].pending_prefill_tokens} "
                    f"<= {self.pending_threshold_tokens})",
                    scores=scores, predicted_hit_blocks=insts[b].gpu_hit_blocks,
                )
            why = f"bound instance {b} overloaded (pending {insts[b].pending_prefill_tokens} > " \
                  f"{self.pending_threshold_tokens})"
        else:
            why = "new session" if b is None else f"bound instance {b} unhealthy"
        best = min(cands, key=lambda s: (s.pending_prefill_tokens, s.in_flight, s.index))
        return Decision(
            FORWARD, best.index,
            f"unified: {why}; least pending prefill {best.pending_prefill_tokens} on instance {best.index}",
            scores=scores, predicted_hit_blocks=best.gpu_hit_blocks,
        )


@register("lmetric")
def _lmetric(name: str, params: Mapping[str, Any]) -> LMetric:
    parse_params("lmetric", params, {})
    return LMetric(name=name)


@register("linear")
def _linear(name: str, params: Mapping[str, Any]) -> Linear:
    nonneg = lambda v: v >= 0
    p = parse_params(
        "linear",
        params,
        {
            "variant": Param("str", "ratio", lambda v: v in ("ratio", "dynamo"), "ratio or dynamo"),
            "hit_ratio_weight": Param("float", 1.0, nonneg, ">= 0"),
            "load_weight": Param("float", 1.0, nonneg, ">= 0"),
            "overlap_weight": Param("float", 1.0, nonneg, ">= 0"),
        },
    )
    return Linear(name=name, **p)


@register("unified")
def _unified(name: str, params: Mapping[str, Any]) -> Unified:
    p = parse_params(
        "unified", params, {"pending_threshold_tokens": Param("int", 32768, lambda v: v >= 0, ">= 0")}
    )
    return Unified(name=name, **p)
