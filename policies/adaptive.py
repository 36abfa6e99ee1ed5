"""GPU-hit-first routing that adapts to the traffic it sees: ``lpwl_auto``.

Why ``lpwl_resident`` loses on chat-shaped traffic (seen in the lost-hit and per-instance views of
``gpuhit lost-hits``):

* It counts every session that finished a turn within the live window as HBM the instance must
  keep. On a trace where most sessions are a single turn (the bundled Mooncake conversation trace:
  three in four), that working set is mostly sessions that never return, more than the cluster's
  HBM; every instance then "overflows", the overflow charge cancels the prefix hit everywhere, and
  placement degenerates into ranking instances by how many dead sessions they hosted.
* LPWL's score (``pending prefill + input - hit``) counts the new request's own wait but not what
  its prefill does to the requests already on the instance. Under vLLM's chunked prefill a step
  carries every running decode plus a chunk of prefill, and its duration is dominated by the chunk
  (the H20 profile: 43 us per prefill token against 41 ns per decoded context token), so each
  prefill token delays every co-running request by about one prefill-token time. Where prompts are
  mostly new (low reuse) and their sizes spread wide (the Mooncake trace: a tenth over 32k tokens),
  that externality is most of the latency: LMetric's ``P x batch`` ranks by it, LPWL ignores it.
* Charged in full, that externality makes a request queue behind other prefills to spare a few
  decoders even where its prompt is no larger than the prefill that will reach them anyway. On the
  Azure conversation trace (no prefix reuse, prompts ~1.2k tokens, ~40 requests in flight per
  instance) a quarter of the decisions did that (an instance with ~1.4k tokens of work queued over
  one with none, to spare ~1.6 in-flight requests): mean latency gained what the trade predicts
  (tens of milliseconds), first tokens and the median lost more, and every load balancer had the
  better TTFT p90 (``analysis/results/policy-typical-prefill-2026-11-27.md``). Past the knee, where
  every instance has prefill queued, the same trade went on against the least-queued instance: a
  third of the decisions queued ~1.1k tokens of work deeper to spare ~2.4 of ~80 in-flight
  requests, and the load balancers kept the better TTFT p90 and median
  (``analysis/results/policy-least-queued-2026-11-27.md``).
* Counted in tokens, prefill work undercounts long prompts. A prefill of ``n`` new tokens after
  ``c`` cached ones takes ``a*n + b*((c+n)^2 - c^2)`` (attention over the whole context;
  :class:`~policies.costmodel.PrefillProfile`): a 50k-token cold prompt ~3.9x what its token count
  says, a 1k one ~1.06x. On the Mooncake trace (mean input ~12k tokens, a tenth over 32k) the
  requests in the TTFT tail are those long prompts, and a token-count rule parked them behind
  other long prompts that looked cheap: at the knee they waited 2.2 s on average before their own
  prefill against 1.3 s under ``lmetric_plus1`` (queued prefill at placement 14k against 7k
  tokens), which gave ``lmetric_plus1`` the lower TTFT p90.

``lpwl_auto`` prices them all, in one unit, with no parameter: prefill *work*, the prefill's time
over ``a`` (:func:`~policies.costmodel.prefill_work_tokens`: tokens, plus the attention term; only
the ratio ``b / a`` enters, from the *GPU-Hit-First* note's prefill measurements as
``policies/costmodel.py`` fits them). The gateway sums the same unit over each instance's queued
prefills (``pending_prefill_work``) and observes its median over the recently routed requests
(``observed_prefill_work``, ``gateway/residency.py``). For each healthy instance ``i``:

    new_i      = input - gpu_hit_i                         this request's prefill there
    W_i        = work(new_i after hit_i)                    its time there, in token equivalents
    Q_i        = pending_prefill_work_i                     the prefills queued there, the same unit
    Wtyp       = observed_prefill_work                      the typical (median) routed prefill
    Qmin       = min over healthy instances of Q_j           the soonest any request can start
    X_i        = max(0, W_i - Wtyp) if Q_i = Qmin else W_i  the avoidable part of its delay to others
    need       = ceil((input + output) / block_size)        its blocks after the turn
    overflow_i = max(0, E_i + need - C_i)                    E_i: expected resident blocks
    lost_i     = min(gpu_hit_blocks_i, overflow_i)
    cost_i     = Q_i + W_i + X_i * in_flight_i + work(block_size * lost_i) + work(block_size * overflow_i)

and routes to ``argmin cost_i`` (ties: :func:`~policies.common.tie_key`). ``Q_i + W_i`` is LPWL
in time (the request's own time to first token); ``X_i * in_flight_i`` the part of the delay its
prefill adds to the ``in_flight_i`` requests sharing the instance's steps that placement avoids.
The instance with the least prefill queued (none, below the knee) is where any request starts
soonest: if this one does not take it, the next one will, and its decoders pay for *that* prefill,
most likely ``Wtyp``, anyway (the
median, not the mean: prompt sizes are heavy-tailed, and against the mean most prefills of the
Mooncake trace counted as small, even those of 0.5-1 s, so they stopped weighing in-flight
requests and its mean and median latency rose past the knee).
Exchanging the two placements changes what the decoders pay by ``(W - Wtyp) x (in_flight_i -
in_flight_j)``, so such an instance is charged only the excess: a request of typical size does not
queue behind other prefills elsewhere to spare its decoders (it starts now, on the idle instance
with fewest in flight: the tie-break), a long one still goes where fewer requests decode. Any
other instance is no slot the next request is bound to fill, and a prefill placed there is charged
in full. This holds past the knee too, where every instance has a queue: the least-queued one is
the slot, so a request no longer queues deeper behind other prefills to spare a few of the ~80
requests decoding beside it (with the full charge there, the Azure trace's TTFT p90 and median
stayed behind every load balancer's at 1.3x knee; the price is the mean those trades bought, a few
milliseconds). (The negative part is not credited: that sends short prompts to the busiest
instances. Nor is the excess charged on every instance: past the knee that sorts prompts by size,
the long ones onto the instances with fewest in flight, whose few decoders then carry most of the
prefill, and the typical ones onto the rest, whose decodes run slower.)
Before the first request is routed ``Wtyp`` is 0 (the whole prefill is charged everywhere).

The residency charge is ``lpwl_resident``'s (the lost hit, recomputed at this session's next turn,
and the overflow, recomputed at the victims'), priced in the same work (each as a prefix recomputed
from scratch), over ``E_i`` = :attr:`InstanceState.expected_resident_blocks`: in-flight sessions
in full, idle live ones weighted by the observed share of idle sessions that come back
(``gateway/residency.py``). Where reuse is high (a warm agentic session: ``new`` a few hundred
tokens on its holder, far below ``Wtyp``) the session sticks by its own wait, as under LPWL, and a
cold placement of its context elsewhere is charged in full; where prompts are new, the long ones
go where fewer requests decode and those of typical size where they start soonest; the observed
return rate decides how much of the idle working set to keep.

Priority (default ``saved``): vLLM's per-request ``priority``, the key of each engine's waiting
queue; the modes (``aged``, ``saved``, ``finish``, ``session_start``, ``none``), their sources and
how far each lets a request be overtaken are in ``policies/priority_keys.py``.

Migration (``migrate: priced``; default ``none``): when the holder of the request's longest GPU
prefix is not the cheapest target, the policy also prices moving that KV to each other instance
(the two-step ``MIGRATE``: a producer step on the holder at the turn's own priority, the transfer,
then the turn on the target; ``policies/migration.py``) and moves it where that beats the cheapest
recompute.

Late binding (``hold: saturated``; default ``none``): the gateway holds a request while every
healthy instance is *saturated*, i.e. has prefill queued or running (``pending_prefill_work > 0``:
a new prefill there would wait), and routes it by the rule above when one drains
(``gateway/hold.py``). No threshold: "would wait" is the only line that needs none. Off by
default: a held request starts its trip through the engine's frontend (HTTP, tokenization) only when
released, and ``pending_prefill_work`` counts a request in that frontend as queued, so on the Azure
trace, where a prefill is shorter than the frontend, instances stood idle between releases and
first tokens came seconds later (``analysis/results/policy-least-queued-2026-11-27.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.common import Param, healthy, new_prefill_tokens, parse_params, tie_key
from policies.costmodel import prefill_work_tokens
from policies.migration import holder, migrate_work
from policies.priority_keys import AGING, PRIORITIES, aged_priority, finish_priority, saved_priority
from policies.registry import register
from policies.resident import session_priority
from policies.snapshot import FORWARD, MIGRATE, Decision, InstanceState, Snapshot

HOLDS = ("none", "saturated")
MIGRATES = ("none", "priced")


def typical_work(snapshot: Snapshot) -> int:
    """``Wtyp`` of the module docstring: the observed median prefill work of recently routed
    requests, or 0 (the whole prefill charged) before the first one."""
    w = snapshot.observed_prefill_work
    return 0 if w is None else int(w)


def auto_cost(snapshot: Snapshot, s: InstanceState, typical: int = 0, least_queued: int = 0) -> tuple[int, int, int, int]:
    """``(cost, work, overflow, lost)`` of placing this request on ``s`` (the module docstring's
    rule; ``work`` is ``W_i``, ``typical`` is ``Wtyp``: :func:`typical_work`, ``least_queued`` is
    ``Qmin``, the least prefill work queued on any healthy instance)."""
    req = snapshot.request
    bs = req.block_size
    new = new_prefill_tokens(snapshot, s)
    work = prefill_work_tokens(new, req.input_tokens - new)
    avoidable = work if s.pending_prefill_work > least_queued else max(0, work - typical)
    cost = s.pending_prefill_work + work + avoidable * s.in_flight
    cap = s.capacity_blocks
    if cap is None:
        return cost, work, 0, 0
    need = -(-(req.input_tokens + req.output_tokens) // bs)
    overflow = max(0, s.expected_resident_blocks + need - cap)
    lost = min(s.gpu_hit_blocks, overflow)
    return cost + prefill_work_tokens(bs * lost) + prefill_work_tokens(bs * overflow), work, overflow, lost


def saturated(snapshot: Snapshot) -> bool:
    """Every healthy instance has prefill queued or running: a new prefill would wait anywhere."""
    return all(s.pending_prefill_work > 0 for s in healthy(snapshot))


@dataclass(frozen=True, slots=True)
class LPWLAuto:
    name: str = "lpwl_auto"
    type: str = "lpwl_auto"
    priority: str = "saved"
    aging: str = "p50"
    hold_when: str = "none"
    migrate: str = "none"
    reads_residency = True  # the router fills the resident blocks and the observed service time
    reads_prefill_work = True  # and each instance's queued prefill work (pending_prefill_work)

    @property
    def holds(self) -> bool:
        """Whether the gateway should keep a hold queue for this policy (gateway/hold.py)."""
        return self.hold_when != "none"

    def hold(self, snapshot: Snapshot) -> bool:
        """The hold rule (module docstring): wait while every instance is saturated."""
        return self.hold_when == "saturated" and saturated(snapshot)

    @property
    def scheduling_policy(self) -> str:
        """The vLLM ``--scheduling-policy`` the engines need for this policy's decisions."""
        return "fcfs" if self.priority == "none" else "priority"

    def _migration(self, snapshot: Snapshot, keyed: list, best: int) -> Decision | None:
        """The cheapest move of the prefix holder's KV (``policies/migration.py``), when it beats
        ``best``, the cheapest forward; the move's target pays the same residency charge as a
        forward there, the whole moved context counting as the hit it may lose."""
        src = holder(snapshot)
        if src is None:
            return None
        bs = snapshot.request.block_size
        moves = []
        for _, tie, i, _, overflow, _ in keyed:
            m = migrate_work(snapshot, src, snapshot.instances[i])
            if m is not None:
                charge = prefill_work_tokens(bs * min(src.gpu_hit_blocks, overflow)) + prefill_work_tokens(bs * overflow)
                moves.append((m + charge, tie, i))
        if not moves or min(moves)[0] >= best:
            return None
        cost, _, target = min(moves)
        prio = self._priority(snapshot, snapshot.hit_tokens(src.index))
        return Decision(
            MIGRATE, target,
            f"{self.name}: move {src.gpu_hit_blocks} blocks from instance {src.index} (pending "
            f"{src.pending_prefill_tokens}, work {src.pending_prefill_work}): cost {cost} < {best} recomputing",
            source=src.index, scores=tuple((k[2], float(k[0])) for k in keyed),
            predicted_hit_blocks=src.gpu_hit_blocks, priority=prio, producer_priority=prio,
        )

    def _priority(self, snapshot: Snapshot, hit_tokens: int) -> int | None:
        """The request's vLLM priority (``policies/priority_keys.py``); ``hit_tokens``: its predicted prefix hit
        where it will run (for a move, the prefix the target imports)."""
        if self.priority == "none":
            return None
        if self.priority == "session_start":
            return session_priority(snapshot)
        if self.priority == "saved":
            return saved_priority(snapshot, hit_tokens, self.aging)
        if self.priority == "finish":
            return finish_priority(snapshot, hit_tokens, self.aging)
        return aged_priority(snapshot, self.aging)

    def decide(self, snapshot: Snapshot) -> Decision:
        keyed = []
        typical = typical_work(snapshot)
        cands = healthy(snapshot)
        least = min(s.pending_prefill_work for s in cands)
        for s in cands:
            cost, work, overflow, lost = auto_cost(snapshot, s, typical, least)
            keyed.append((cost, tie_key(s), s.index, work, overflow, lost))
        cost, _, target, work, overflow, lost = min(keyed)
        if self.migrate == "priced":
            moved = self._migration(snapshot, keyed, cost)
            if moved is not None:
                return moved
        inst = snapshot.instances[target]
        room = "capacity unknown: no residency charge" if inst.capacity_blocks is None else (
            f"expected resident {inst.expected_resident_blocks} of {inst.capacity_blocks} blocks: "
            f"overflow {overflow}, hit lost {lost}")
        return Decision(
            FORWARD, target,
            f"{self.name}: pending {inst.pending_prefill_tokens} (work {inst.pending_prefill_work}) + new "
            f"{new_prefill_tokens(snapshot, inst)} (work {work}, typical {typical}) x {inst.in_flight} in flight "
            f"(hit {inst.gpu_hit_blocks} blocks); {room}; cost {cost} is the least",
            scores=tuple((k[2], float(k[0])) for k in keyed),
            predicted_hit_blocks=inst.gpu_hit_blocks, priority=self._priority(snapshot, snapshot.hit_tokens(target)),
        )


@register("lpwl_auto")
def _lpwl_auto(name: str, params: Mapping[str, Any]) -> LPWLAuto:
    p = parse_params(
        "lpwl_auto", params,
        {"priority": Param("str", "saved", lambda v: v in PRIORITIES, " | ".join(PRIORITIES)),
         "aging": Param("str", "p50", lambda v: v in AGING, " | ".join(AGING)),
         "hold": Param("str", "none", lambda v: v in HOLDS, " | ".join(HOLDS)),
         "migrate": Param("str", "none", lambda v: v in MIGRATES, " | ".join(MIGRATES))},
    )
    return LPWLAuto(name=name, priority=p["priority"], aging=p["aging"], hold_when=p["hold"], migrate=p["migrate"])
