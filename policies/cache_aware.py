"""Cache-aware baselines as production routers do them: lmetric (and its ``+1`` variant), linear
(and its Dynamo variant), unified.

Tie-breaks (deterministic, pure functions of the snapshot): after each policy's own score (and, for
lmetric, its prefill factor), :func:`policies.common.tie_key`: fewer in-flight, then fewer routed so
far, then lower index. Linear (ratio) is an argmax of its score, the rest argmins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from policies.common import Param, fmt, healthy, new_prefill_tokens, parse_params, tie_key
from policies.registry import register
from policies.snapshot import FORWARD, Decision, Snapshot


@dataclass(frozen=True, slots=True)
class LMetric:
    """LMetric as published: ``argmin P x B``.

    Zhang et al., "LMetric: Simple is Better - Multiplication May Be All You Need for LLM Request
    Scheduling" (OSDI'26, arXiv 2603.15202), abstract: "using a simple multiplication of two carefully
    chosen indicators -- one for KV$-aware (new prefill tokens if routed to an instance) and one for
    load balancing-aware (current batch size of the instance) -- as the scheduling score". Only the
    abstract (and third-party summaries of it) could be found, not the paper's body, so the section
    defining the score and its zero case could not be quoted; the factors follow the *GPU-Hit-First*
    note's reading of it (README "References": ``P x num_requests``, ``P = pending_prefill + (input - cache_hit)``):

    - ``P`` = the instance's pending prefill tokens + this request's ``input - GPU hit`` tokens
      (>= 1: vLLM always recomputes the last prompt token);
    - ``B`` = the instance's current batch: requests routed to it and not finished (``in_flight``);
      no ``+1``.

    Zero factor: an idle instance (``B = 0``) scores 0 whatever its cache. The product then says
    nothing about which idle instance is better, so ties on the product (every idle instance, or equal
    products) go to the lower ``P`` (the cache indicator: the idle instance holding most of the
    prefix), then :func:`~policies.common.tie_key`. This tie rule is ours, documented as such: the
    abstract only says the conditions under which multiplication fails "are extremely rare in practice
    and can be detected (and mitigated) beforehand". ``P`` is never 0 here (see above), so the
    both-factors-zero case does not arise. The ``(B + 1)`` form is :class:`LMetricPlus1`.
    """

    name: str = "lmetric"
    type: str = "lmetric"
    reads_engine_stats: ClassVar[bool] = False

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        keyed = []
        for s in cands:
            p = s.pending_prefill_tokens + new_prefill_tokens(snapshot, s)
            keyed.append((float(p * s.in_flight), p, tie_key(s), s))
        score, p, _, inst = min(keyed, key=lambda k: k[:3])
        why = " (idle: the zero batch ties idle instances, broken by the lower P)" if inst.in_flight == 0 else ""
        return Decision(
            FORWARD, inst.index,
            f"lmetric: P (pending {inst.pending_prefill_tokens} + new {new_prefill_tokens(snapshot, inst)}) x "
            f"batch {inst.in_flight} = {fmt(score)} is the lowest{why}",
            scores=tuple((k[3].index, k[0]) for k in keyed), predicted_hit_blocks=inst.gpu_hit_blocks,
        )


@dataclass(frozen=True, slots=True)
class LMetricPlus1:
    """Variant, not the published rule: ``argmin (pending_prefill + input - hit) x (batch + 1)``.

    Counts the request being routed in the batch, so an idle instance scores its ``P`` instead of 0
    and the product never vanishes. It was gpuhit's ``lmetric`` before the published form replaced it
    (results labelled lmetric before that change used this form). The product dilutes cache affinity:
    an instance holding the whole prefix but running a few requests loses to an idle cold one, whose
    large ``P`` is multiplied by 1. Ties: :func:`~policies.common.tie_key`.
    """

    name: str = "lmetric_plus1"
    type: str = "lmetric_plus1"
    reads_engine_stats: ClassVar[bool] = False

    def decide(self, snapshot: Snapshot) -> Decision:
        cands = healthy(snapshot)
        keyed = [
            (float((s.pending_prefill_tokens + new_prefill_tokens(snapshot, s)) * (s.in_flight + 1)), tie_key(s), s)
            for s in cands
        ]
        score, _, inst = min(keyed, key=lambda k: k[:2])
        return Decision(
            FORWARD, inst.index,
            f"lmetric_plus1: (pending {inst.pending_prefill_tokens} + new {new_prefill_tokens(snapshot, inst)}) x "
            f"(batch {inst.in_flight} + 1) = {fmt(score)} is the lowest",
            scores=tuple((k[2].index, k[0]) for k in keyed), predicted_hit_blocks=inst.gpu_hit_blocks,
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
    reads_engine_stats: ClassVar[bool] = False
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
                scored.append((self.overlap_weight * prefill_blocks + decode_blocks, tie_key(s), s.index))
            cost, _, target = min(scored)
            reason = f"linear/dynamo: overlap_weight x prefill_blocks + decode_blocks = {fmt(cost)} is the lowest"
            scores = tuple((i, c) for c, _, i in scored)
        else:
            max_load = max(s.in_flight for s in cands)
            scored = []
            for s in cands:
                ratio = snapshot.hit_tokens(s.index) / req.input_tokens
                load = s.in_flight / max_load if max_load else 0.0
                scored.append((-(self.hit_ratio_weight * ratio - self.load_weight * load), tie_key(s), s.index))
            neg, _, target = min(scored)
            reason = f"linear: hit_ratio_weight x hit/input - load_weight x load = {fmt(-neg)} is the highest"
            scores = tuple((i, -n) for n, _, i in scored)
        return Decision(
            FORWARD, target, reason, scores=scores, predicted_hit_blocks=snapshot.instances[target].gpu_hit_blocks
        )


@dataclass(frozen=True, slots=True)
class Unified:
    """Sticky for warm sessions, load-aware for new ones.

    A session bound to a healthy instance stays there unless that instance's pending prefill exceeds
    ``pending_threshold_tokens`` (default 32768 tokens, ~1.6 s of queued prefill at the profile's
    50 us/token); then, and for new sessions, the request goes to the instance with the least
    pending prefill (ties: :func:`~policies.common.tie_key`), ignoring the cache. Scores: pending
    prefill tokens of every candidate (lower is better).
    """

    name: str = "unified"
    type: str = "unified"
    reads_engine_stats: ClassVar[bool] = False
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
        best = min(cands, key=lambda s: (s.pending_prefill_tokens, *tie_key(s)))
        return Decision(
            FORWARD, best.index,
            f"unified: {why}; least pending prefill {best.pending_prefill_tokens} on instance {best.index}",
            scores=scores, predicted_hit_blocks=best.gpu_hit_blocks,
        )


@register("lmetric")
def _lmetric(name: str, params: Mapping[str, Any]) -> LMetric:
    parse_params("lmetric", params, {})
    return LMetric(name=name)


@register("lmetric_plus1")
def _lmetric_plus1(name: str, params: Mapping[str, Any]) -> LMetricPlus1:
    parse_params("lmetric_plus1", params, {})
    return LMetricPlus1(name=name)


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
