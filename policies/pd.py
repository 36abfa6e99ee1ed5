"""Static prefill/decode disaggregation (DistServe / Splitwise style): pd_disagg.

The prefill pool is the instances whose role is "prefill" when any instance has a role other than
"both"; otherwise the first ``num_prefill`` instances. Every other instance decodes. Each request is
prefilled on the prefill instance with the least ``pending_prefill + input - hit`` and decoded on the
decode instance with the fewest decode sequences (ties, both: :func:`~policies.common.tie_key`, fewer
in-flight, fewer routed so far, lower index); the router moves the KV between them (action PD).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gpuhit.errors import ConfigError, NoInstanceError
from policies.common import Param, healthy, new_prefill_tokens, parse_params, tie_key
from policies.registry import register
from policies.snapshot import PD, Decision, Snapshot


@dataclass(frozen=True, slots=True)
class PDDisagg:
    name: str = "pd_disagg"
    type: str = "pd_disagg"
    reads_engine_stats: ClassVar[bool] = False
    num_prefill: int | None = None

    def pools(self, snapshot: Snapshot) -> tuple[list[int], list[int]]:
        insts = snapshot.instances
        if any(s.role != "both" for s in insts):
            pre = [s.index for s in insts if s.role == "prefill"]
            dec = [s.index for s in insts if s.role != "prefill"]
        else:
            if self.num_prefill is None:
                raise ConfigError("pd_disagg: give num_prefill or engine roles ('prefill' / 'decode')")
            if not 0 < self.num_prefill < len(insts):
                raise ConfigError(
                    f"pd_disagg: num_prefill={self.num_prefill} must leave both pools non-empty "
                    f"with {len(insts)} instances"
                )
            pre = list(range(self.num_prefill))
            dec = list(range(self.num_prefill, len(insts)))
        if not pre or not dec:
            raise ConfigError(f"pd_disagg: empty pool (prefill {pre}, decode {dec})")
        return pre, dec

    def decide(self, snapshot: Snapshot) -> Decision:
        pre, dec = self.pools(snapshot)
        try:
            p_cands = healthy(snapshot, pre)
        except NoInstanceError:
            raise NoInstanceError("pd_disagg: no healthy prefill instance") from None
        try:
            d_cands = healthy(snapshot, dec)
        except NoInstanceError:
            raise NoInstanceError("pd_disagg: no healthy decode instance") from None
        pkeyed = [(s.pending_prefill_tokens + new_prefill_tokens(snapshot, s), tie_key(s), s.index) for s in p_cands]
        pwork, _, p = min(pkeyed)
        d = min(d_cands, key=lambda s: (s.decode_seqs, *tie_key(s)))
        scores = tuple((i, float(w)) for w, _, i in pkeyed) + tuple((s.index, float(s.decode_seqs)) for s in d_cands)
        return Decision(
            PD, d.index,
            f"pd_disagg: prefill on {p} (prefill work {pwork}), decode on {d.index} ({d.decode_seqs} decoding)",
            source=p, scores=scores, predicted_hit_blocks=snapshot.request.num_blocks,
        )


@register("pd_disagg")
def _pd(name: str, params: Mapping[str, Any]) -> PDDisagg:
    p = parse_params("pd_disagg", params, {"num_prefill": Param("int", None, lambda v: v > 0, "> 0")})
    return PDDisagg(name=name, **p)
