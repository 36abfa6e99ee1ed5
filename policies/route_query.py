"""route_query: per request, stay on the GPU holder, fetch its KV to a lighter instance, or recompute
there, whichever :mod:`policies.costmodel` predicts reaches the first token soonest.

For every healthy instance ``i`` it predicts (see :class:`~policies.costmodel.ServingCostModel`):

* run on ``i`` with its own prefix hit: ``queue(i) + T_prefill(input - hit_i, hit_i)`` - "stay" on
  the holder (the instance with the largest GPU hit), "recompute" elsewhere;
* if the holder ``H`` has a longer prefix than ``i``: fetch it, ready at
  ``max(producer_wait x queue(H) + T_transfer, queue(i)) + T_prefill(input - hit_H, hit_H)``,

with ``queue(i) = pending_prefill_tokens(i) x per-token prefill time``. It takes the minimum; ties
go to the option that moves nothing (stay/recompute before fetch), then
:func:`~policies.common.tie_key` of the target (fewer in-flight, fewer routed so far, lower index),
so equally fast idle instances share cold sessions instead of the lowest index taking them all. Scores:
each instance's best predicted seconds.

Params (defaults): ``fabric`` ("nic": 9.7 GB/s, the PD KV transfer rate of the *GPU-Hit-First* note; or any of
:data:`~policies.costmodel.FABRICS`), ``nic_gbps`` (overrides the fabric's bandwidth),
``kv_bytes_per_token`` (98304), ``prefill_a`` (50e-6 s), ``prefill_b`` (2.94e-9 s),
``queue_us_per_token`` (the profile's ``a`` x 1e6 = 50), ``producer_wait`` (1.0: with vLLM's
connector protocol the holder serves a producer request behind its own queue), ``splice_ms`` (0).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from policies.common import Param, healthy, parse_params, tie_key
from policies.costmodel import FABRICS, OptionCost, PrefillProfile, ServingCostModel, get_fabric
from policies.registry import register
from policies.snapshot import FETCH, FORWARD, Decision, Snapshot

_RANK = {"stay": 0, "recompute": 0, "fetch": 1}


@dataclass(frozen=True, slots=True)
class RouteQuery:
    name: str = "route_query"
    type: str = "route_query"
    reads_engine_stats: ClassVar[bool] = False
    model: ServingCostModel = field(default_factory=ServingCostModel)

    def options(self, snapshot: Snapshot) -> list[OptionCost]:
        """Every option considered, in a deterministic order."""
        cands = healthy(snapshot)
        m = self.model
        n_in = snapshot.request.input_tokens
        hits = {s.index: snapshot.hit_tokens(s.index) for s in cands}
        holder = min(cands, key=lambda s: (-hits[s.index], s.pending_prefill_tokens, s.index))
        h_hit = hits[holder.index]
        opts: list[OptionCost] = []
        for s in cands:
            i = s.index
            kw = {"target": i, "pending_prefill_tokens": s.pending_prefill_tokens, "input_tokens": n_in,
                  "hit_tokens": hits[i]}
            opts.append(m.stay(**kw) if i == holder.index else m.recompute(**kw))
            if i != holder.index and h_hit >= snapshot.request.block_size + hits[i]:
                opts.append(
                    m.fetch(
                        source=holder.index,
                        target=i,
                        source_pending_prefill_tokens=holder.pending_prefill_tokens,
                        target_pending_prefill_tokens=s.pending_prefill_tokens,
                        input_tokens=n_in,
                        source_hit_tokens=h_hit,
                        target_hit_tokens=hits[i],
                    )
                )
        return opts

    def decide(self, snapshot: Snapshot) -> Decision:
        opts = self.options(snapshot)
        best_by_inst: dict[int, float] = {}
        for o in opts:
            t = o.total_s
            if o.target not in best_by_inst or t < best_by_inst[o.target]:
                best_by_inst[o.target] = t
        insts = snapshot.instances
        best = min(opts, key=lambda o: (o.total_s, _RANK[o.kind], tie_key(insts[o.target])))
        scores = tuple(sorted(best_by_inst.items()))
        detail = (
            f"queue {best.queue_s * 1e3:.3g} ms + transfer {best.transfer_s * 1e3:.3g} ms + "
            f"prefill {best.prefill_s * 1e3:.3g} ms = {best.total_s * 1e3:.4g} ms"
        )
        if best.kind == "fetch":
            assert best.source is not None
            blocks = max(insts[best.source].gpu_hit_blocks, insts[best.target].gpu_hit_blocks)
            return Decision(
                FETCH, best.target, f"route_query: fetch KV from {best.source} to {best.target}: {detail}",
                source=best.source, scores=scores, predicted_hit_blocks=blocks,
            )
        return Decision(
            FORWARD, best.target, f"route_query: {best.kind} on {best.target}: {detail}",
            scores=scores, predicted_hit_blocks=insts[best.target].gpu_hit_blocks,
        )


@register("route_query")
def _route_query(name: str, params: Mapping[str, Any]) -> RouteQuery:
    pos = lambda v: v > 0
    nonneg = lambda v: v >= 0
    p = parse_params(
        "route_query",
        params,
        {
            "fabric": Param("str", "nic", lambda v: v in FABRICS, f"one of {sorted(FABRICS)}"),
            "nic_gbps": Param("float", None, pos, "> 0 GB/s"),
            "kv_bytes_per_token": Param("int", 98304, pos, "> 0"),
            "prefill_a": Param("float", 50e-6, nonneg, ">= 0 s/token"),
            "prefill_b": Param("float", 2.94e-9, nonneg, ">= 0 s/token^2"),
            "queue_us_per_token": Param("float", None, nonneg, ">= 0 us"),
            "producer_wait": Param("float", 1.0, lambda v: 0 <= v <= 1, "within [0, 1]"),
            "splice_ms": Param("float", 0.0, nonneg, ">= 0 ms"),
        },
    )
    model = ServingCostModel(
        profile=PrefillProfile(p["prefill_a"], p["prefill_b"]),
        fabric=get_fabric(p["fabric"], bw_gbps=p["nic_gbps"]),
        kv_bytes_per_token=p["kv_bytes_per_token"],
        per_token_queue_s=None if p["queue_us_per_token"] is None else p["queue_us_per_token"] * 1e-6,
        producer_wait=p["producer_wait"],
        splice_s=p["splice_ms"] * 1e-3,
    )
    return RouteQuery(name=name, model=model)
