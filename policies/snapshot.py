"""Frozen messages between the gateway's mechanism and the pure policies.

The router builds one :class:`Snapshot` per request (no I/O, no awaiting), hands it to
``policy.decide(snapshot)``, and carries out the returned :class:`Decision`. Policies never see
mutable gateway state: everything they may use is copied in here.
"""

from __future__ import annotations

import msgspec

from engines.base import max_cached_tokens

FORWARD = "forward"  # run the request on ``target``
MIGRATE = "migrate"  # move the session's KV from ``source`` to ``target``, rebind, then run on target
FETCH = "fetch"  # pull this request's prefix KV from ``source`` to ``target`` for this request only
PD = "pd"  # prefill on ``source`` (producer), decode on ``target`` (consumer), KV moved between
ACTIONS = (FORWARD, MIGRATE, FETCH, PD)


class InstanceState(msgspec.Struct, frozen=True, gc=False):
    """One instance as the policy sees it at decision time."""

    index: int
    name: str
    role: str = "both"  # "both" | "prefill" | "decode"
    healthy: bool = True
    # Counted by the gateway from its own routing (exact, instant):
    in_flight: int = 0  # routed, not finished
    pending_prefill_tokens: int = 0  # sum over routed, not-yet-first-token requests of (input - predicted hit)
    decode_seqs: int = 0  # past first token, not finished
    active_blocks: int = 0  # KV blocks (prompt + output) of the routed, unfinished requests (Dynamo's load)
    # Reported by the engine (scraped /metrics or in-process stats); None = unknown:
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    capacity_blocks: int | None = None
    # This request's prefix hit on this instance, in engine blocks, from the KV index:
    gpu_hit_blocks: int = 0
    cpu_hit_blocks: int = 0  # further blocks beyond the GPU hit found in the CPU tier
    # Requests the gateway has sent here so far (as target, or as the KV source of a fetch, migration
    # or PD prefill): the last deterministic tie-break of argmin/argmax policies, so ties rotate over
    # instances instead of favouring index 0.
    routed: int = 0
    # KV blocks (context after their last turn) of the OTHER live sessions bound here: a request in
    # flight, or idle for less than the live window (see gateway/residency.py). The working set this
    # instance should keep in HBM. Filled only for policies with ``reads_residency = True`` (else 0).
    resident_blocks: int = 0
    # The same sessions with each idle one weighted by the observed share of idle sessions that
    # return (the gateway's residency observer); filled with resident_blocks.
    expected_resident_blocks: int = 0
    # The same requests' prefill time in linear-token equivalents, the attention term included
    # (:func:`policies.costmodel.prefill_work_tokens` of each one's new and cached tokens). Filled
    # only for policies with ``reads_prefill_work = True`` (else 0): pricing costs every request.
    pending_prefill_work: int = 0


class RequestView(msgspec.Struct, frozen=True, gc=False):
    request_id: str
    input_tokens: int
    num_blocks: int  # full engine blocks of the prompt
    block_size: int
    output_tokens: int = 0  # requested max_tokens (exact in replay)
    session_id: str | None = None
    parent_session: str | None = None
    turn: int = 0  # 0-based turn index within the session, when known
    seq: int = 0  # gateway-wide request counter (round robin uses it)


class Snapshot(msgspec.Struct, frozen=True, gc=False):
    now: float
    request: RequestView
    instances: tuple[InstanceState, ...]
    binding: int | None = None  # instance the session is bound to, if any
    last_migrated_at: float | None = None  # when this session was last migrated
    session_started_at: float | None = None  # when the gateway first saw this session (None: first turn)
    # Median time from a turn's arrival at the gateway to its finish over recent turns (None before
    # the first finish): observed by the gateway's residency observer, filled for residency readers.
    observed_service_s: float | None = None
    observed_service_p90_s: float | None = None  # the same turns' 90th percentile
    # Median prefill work (policies.costmodel.prefill_work_tokens) of the recently routed requests
    # (None before the first): observed by the residency observer, filled for policies that price work.
    observed_prefill_work: float | None = None

    def hit_tokens(self, i: int) -> int:
        """GPU prefix-hit tokens of this request on instance ``i``, as vLLM serves them: whole
        blocks, never the last prompt token (:func:`engines.base.max_cached_tokens`; a fully cached
        prompt of exactly k blocks gets k - 1 of them)."""
        req = self.request
        bs = req.block_size
        return min(self.instances[i].gpu_hit_blocks * bs, max_cached_tokens(req.input_tokens, bs))


class Decision(msgspec.Struct, frozen=True, gc=False):
    action: str
    target: int
    reason: str
    source: int | None = None
    # Counterfactual: the score every candidate got (lower is better unless the policy says otherwise).
    scores: tuple[tuple[int, float], ...] = ()
    predicted_hit_blocks: int = 0
    # vLLM's per-request ``priority`` (smaller runs first under ``--scheduling-policy priority``), for
    # the target request and for the producer (KV export) step of a KV-moving action. None: the
    # request is forwarded unchanged (vLLM's default 0).
    priority: int | None = None
    producer_priority: int | None = None
