"""A routed request's records and its ticket: what :class:`gateway.router.Router` is asked
(:class:`RouteRequest`), what it logs (:class:`RouteRecord`), its running totals
(:class:`RouterStats`), and the :class:`Ticket` that carries one decision from its opening
(:meth:`Ticket.open`) through the KV two-step's producer step, the first token and the finish,
keeping the router's running counters (in flight, routed, pending prefill, decode slots, active
blocks) exact. A ticket is the router's own accounting: it updates the router's counters directly,
through the :class:`Counters` it is given, and both the opening and the settling live here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from engines.base import GenerateRequest, GenerateResult, max_cached_tokens
from gateway.residency import SessionResidency
from gpuhit.errors import ConfigError
from policies.costmodel import prefill_work_tokens
from policies.snapshot import FORWARD, Decision


class RouteRequest(msgspec.Struct, frozen=True):
    """What the router needs to know about one request. ``block_hashes``: the prompt's full blocks'
    hashes, a tuple or a lazily hashed :class:`engines.hashing.PromptHashes` (the router reads only
    as far as the index's search goes)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    block_hashes: Sequence[int]
    prompt_token_ids: Sequence[int] | None = None
    session_id: str | None = None
    parent_session: str | None = None
    turn: int = 0


class RouteRecord(msgspec.Struct, frozen=True):
    """One routing decision, as logged through ``decision_sink``."""

    request_id: str
    session: str | None
    policy: str
    action: str
    target: int
    source: int | None
    reason: str
    scores: tuple[tuple[int, float], ...]
    predicted_hit_blocks: int
    now: float


def producer_transfer_params(transfer_id: str) -> dict[str, Any]:
    """kv_transfer_params of step (1) of vLLM's connector protocol (the producer)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}


@dataclass(slots=True)
class RouterStats:
    """Running totals (cheap to read at any time)."""

    decisions: int = 0
    decisions_by_policy: dict[str, int] = field(default_factory=dict)
    decisions_by_instance: list[int] = field(default_factory=list)
    actions: dict[str, int] = field(default_factory=dict)
    migrations: int = 0
    fetches: int = 0
    pd_transfers: int = 0
    fallbacks: int = 0
    transferred_tokens: int = 0
    bytes_moved: int = 0
    finished: int = 0
    errors: int = 0
    errors_by_instance: list[int] = field(default_factory=list)
    predicted_hit_tokens: int = 0
    realized_hit_tokens: int = 0
    held: int = 0  # requests that waited in the hold queue (gateway/hold.py)
    held_max: int = 0  # the most that waited there at once

    def as_dict(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "decisions_by_policy": dict(self.decisions_by_policy),
            "decisions_by_instance": list(self.decisions_by_instance),
            "actions": dict(self.actions),
            "migrations": self.migrations,
            "fetches": self.fetches,
            "pd_transfers": self.pd_transfers,
            "fallbacks": self.fallbacks,
            "transferred_tokens": self.transferred_tokens,
            "bytes_moved": self.bytes_moved,
            "finished": self.finished,
            "errors": self.errors,
            "errors_by_instance": list(self.errors_by_instance),
            "predicted_hit_tokens": self.predicted_hit_tokens,
            "realized_hit_tokens": self.realized_hit_tokens,
            "held": self.held,
            "held_max": self.held_max,
        }


class Counters(Protocol):
    """What a :class:`Ticket` updates and calls back on: the router's running counters (per
    instance), its totals, its residency tracker and clock. Named here so that the ticket does not
    import :mod:`gateway.router` (which builds tickets), and so the ticket's reach into the router
    is written down in one place."""

    stats: RouterStats
    residency: SessionResidency
    kv_bytes_per_token: int
    now: Callable[[], float]
    prices_work: bool  # whether the policy reads the prefill work a ticket prices (else it stays 0)
    _in_flight: list[int]
    _routed: list[int]
    _pending: list[int]
    _pending_work: list[int]
    _decode: list[int]
    _active_blocks: list[int]
    _consecutive_errors: list[int]
    hold: Any  # gateway.hold.HoldQueue | None: told when a queued prefill ends or a request finishes

    def hit_tokens_of(self, i: int, req: RouteRequest) -> int: ...

    def _note_error(self, i: int, reason: str) -> None: ...


class Ticket(msgspec.Struct, eq=False):
    """One routed request's life in the router's counters. Not thread-safe (one event loop).
    Built by the router as ``Ticket(router, request, decision, decision.action, decision.target,
    decision.source)``: a msgspec Struct, made in C with every other field at its default (one per
    request; an ``__init__`` setting eighteen slots was a fifth of the ticket's cost). Compared by
    identity (``eq=False``)."""

    router: Counters
    request: RouteRequest
    decision: Decision
    action: str
    target: int
    source: int | None
    transfer_id: str | None = None
    predicted_hit_tokens: int = 0
    producer_prefix_blocks: int = 0
    fallback: bool = False
    producer_result: GenerateResult | None = None
    _pending: int = 0
    _pending_work: int = 0
    _blocks: int = 0
    _prod_pending: int = 0
    _prod_pending_work: int = 0
    _prod_blocks: int = 0
    _prod_open: bool = False
    _first: bool = False
    _done: bool = False

    def open(self, hit_blocks: int, block_size: int, source_hit_blocks: int = 0,
             transfer_id: str | None = None) -> None:
        """Account the decision as routed: the target (and, with a ``transfer_id``, the producer
        step on the source) gets the request in flight, its prefill not served from cache
        (``hit_blocks`` on the target, ``source_hit_blocks`` on the source) and the blocks it will
        hold. :meth:`producer_done`, :meth:`first_token` and :meth:`finish` take them back."""
        r, req, tgt = self.router, self.request, self.target
        cap = max_cached_tokens(req.prompt_len, block_size)
        hit = hit_blocks * block_size
        # min() without its call (see engines.base.max_cached_tokens)
        self.predicted_hit_tokens = hit if hit < cap else cap  # noqa: FURB136
        self._pending = req.prompt_len - self.predicted_hit_tokens
        self._blocks = -(-(req.prompt_len + req.max_tokens) // block_size)
        r._in_flight[tgt] += 1
        r._routed[tgt] += 1
        r._pending[tgt] += self._pending
        if r.prices_work:
            self._pending_work = prefill_work_tokens(self._pending, self.predicted_hit_tokens)
            r._pending_work[tgt] += self._pending_work
        r._active_blocks[tgt] += self._blocks
        if transfer_id is not None:
            src = self.source
            assert src is not None
            self.transfer_id = transfer_id
            self._prod_pending = req.prompt_len - min(source_hit_blocks * block_size, cap)
            if r.prices_work:
                self._prod_pending_work = prefill_work_tokens(self._prod_pending,
                                                              req.prompt_len - self._prod_pending)
            self._prod_blocks = -(-(req.prompt_len + 1) // block_size)
            self._prod_open = True
            r._in_flight[src] += 1
            r._routed[src] += 1
            r._pending[src] += self._prod_pending
            r._pending_work[src] += self._prod_pending_work
            r._active_blocks[src] += self._prod_blocks
        if r.prices_work:  # the typical prefill a routed request brings (gateway/residency.py)
            r.residency.on_prefill_routed(self._pending_work + self._prod_pending_work)

    # -- the KV-moving two-step (MIGRATE / FETCH / PD) ---------------------------------------------

    @property
    def needs_producer(self) -> bool:
        return self.action != FORWARD and not self.fallback

    def producer_request(self) -> GenerateRequest:
        """Step (1): the request to send to ``self.source`` (max_tokens 1, do_remote_decode)."""
        if not self.needs_producer or self.source is None or self.transfer_id is None:
            raise ConfigError(f"request {self.request.request_id}: action {self.action} has no producer step")
        req = self.request
        # The whole prompt, for PD and for MIGRATE / FETCH alike (see the module docstring).
        return GenerateRequest(
            request_id=f"{req.request_id}::producer",
            prompt_len=req.prompt_len,
            max_tokens=1,
            prompt_token_ids=req.prompt_token_ids,
            block_hashes=req.block_hashes,  # type: ignore[arg-type]  # a Sequence (PromptHashes) is fine here
            session_id=req.session_id,
            kv_transfer_params=producer_transfer_params(self.transfer_id),
            priority=self.decision.producer_priority or 0,
        )

    def producer_done(self, result: GenerateResult | None, error: str | None = None) -> Mapping[str, Any] | None:
        """Close step (1). Returns the consumer's kv_transfer_params, or None after a failure, in
        which case the ticket falls back to recomputing on the target (counted in stats.fallbacks)."""
        if not self._prod_open:
            raise ConfigError(f"request {self.request.request_id}: producer step already closed or absent")
        r = self.router
        self._prod_open = False
        src = self.source
        assert src is not None
        r._in_flight[src] -= 1
        r._pending[src] -= self._prod_pending
        r._pending_work[src] -= self._prod_pending_work
        r._active_blocks[src] -= self._prod_blocks
        self.producer_result = result
        err = error or (result.error if result is not None else "no producer result")
        params = None if err else (result.kv_transfer_params if result is not None else None)
        if err or not params:
            self._fall_back()
            r._note_error(src, err or "producer returned no kv_transfer_params")
            return None
        return dict(params)

    def _fall_back(self) -> None:
        r = self.router
        self.fallback = True
        r.stats.fallbacks += 1
        own = r.hit_tokens_of(self.target, self.request)
        new_pending = self.request.prompt_len - own
        new_work = prefill_work_tokens(new_pending, own) if r.prices_work else 0
        if not self._first:
            r._pending[self.target] += new_pending - self._pending
            r._pending_work[self.target] += new_work - self._pending_work
        self._pending = new_pending
        self._pending_work = new_work
        r.stats.predicted_hit_tokens += own - self.predicted_hit_tokens
        self.predicted_hit_tokens = own

    def consumer_request(self, kv_transfer_params: Mapping[str, Any] | None = None) -> GenerateRequest:
        """The request for ``self.target`` (step (2) when ``kv_transfer_params`` is given)."""
        req = self.request
        return GenerateRequest(
            request_id=req.request_id,
            prompt_len=req.prompt_len,
            max_tokens=req.max_tokens,
            prompt_token_ids=req.prompt_token_ids,
            block_hashes=req.block_hashes,  # type: ignore[arg-type]  # a Sequence (PromptHashes) is fine here
            session_id=req.session_id,
            kv_transfer_params=kv_transfer_params,
            priority=self.decision.priority or 0,
        )

    # -- completion hooks --------------------------------------------------------------------------

    def first_token(self) -> None:
        """The target produced its first token: the request's prefill is no longer pending."""
        if self._first or self._done:
            return
        self._first = True
        r = self.router
        t = self.target
        r._pending[t] -= self._pending
        if self._pending_work:  # priced only for a policy that reads it (Router.prices_work)
            r._pending_work[t] -= self._pending_work
        r._decode[t] += 1
        if r.hold is not None:
            r.hold.kick()

    def finish(self, result: GenerateResult | None = None, error: str | None = None) -> None:
        """Release the counters; record realized hits, transferred bytes and errors. Idempotent."""
        if self._done:
            return
        if self._prod_open:  # aborted between the steps
            self.producer_done(None, error or "aborted before the transfer")
        self._done = True
        r = self.router
        t = self.target
        if self._first:
            r._decode[t] -= 1
        else:
            r._pending[t] -= self._pending
            if self._pending_work:
                r._pending_work[t] -= self._pending_work
        r._in_flight[t] -= 1
        r._active_blocks[t] -= self._blocks
        if self.request.session_id is not None:
            r.residency.on_finished(self.request.session_id, t, r.now())
        st = r.stats
        st.finished += 1
        if r.hold is not None:
            r.hold.kick()
        err = error or (result.error if result is not None else None)
        if err:
            r._note_error(t, err)
            return
        r._consecutive_errors[t] = 0
        if result is not None:
            st.realized_hit_tokens += result.cached_tokens + result.external_cached_tokens
            if self.action != FORWARD and not self.fallback:
                moved = result.external_cached_tokens
                st.transferred_tokens += moved
                st.bytes_moved += moved * r.kv_bytes_per_token


