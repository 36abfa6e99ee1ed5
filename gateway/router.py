"""The routing core: snapshot -> pure policy -> action -> completion hooks.

``Router.decide`` is synchronous (no await, no I/O): it copies the gateway's own counters, the
engines' last reported stats, this request's prefix hits from the KV index and the session binding
into a frozen :class:`~policies.snapshot.Snapshot`, asks the policy, and validates the answer.

Two ways to carry a decision out:

* :meth:`Router.begin` returns a :class:`~gateway.ticket.Ticket` for the live HTTP proxy, which streams bytes itself
  and reports back with ``ticket.first_token()`` / ``ticket.finish(...)`` (and, for the KV-moving
  actions, ``ticket.producer_request()`` / ``ticket.producer_done(result)``).
* :meth:`Router.submit` does everything in-process (simulation): begin, act, finish
  (:mod:`gateway.inprocess`).

Actions that move KV (MIGRATE, FETCH, PD) use vLLM's KV-connector two-step, so one protocol serves
emulated and real engines: (1) a producer request on ``decision.source`` with ``max_tokens = 1`` and
``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": T}``;
(2) the real request on ``decision.target`` carrying the ``kv_transfer_params`` the producer returned.
For every action the producer prompt is the WHOLE prompt, as vLLM's connectors require: the consumer
(Nixl, Mooncake: ``get_num_new_matched_tokens`` with ``do_remote_prefill``) expects the remote KV of
all its prompt tokens, and the producer's ``remote_block_ids`` cover the prompt it was given. For
MIGRATE and FETCH the source holds a prefix already, so it computes only the rest of the prompt. If the
producer step fails the request is recomputed on the target (a counted fallback, never silent).

Counters are exact running totals updated at begin / first token / producer done / finish, never
re-summed. Time comes only from the injected ``clock`` or the running loop's ``time()``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgspec

from engines.base import EngineClient, EngineStats, max_cached_tokens
from engines.kv_events import KVEventBatch
from gateway.bindings import SessionBindings
from gateway.hold import HoldQueue
from gateway.inprocess import RoutedResult, accepts_on_progress, run_routed
from gateway.instance_health import InstanceHealth
from gateway.kv_index import KVIndex
from gateway.residency import SessionResidency
from gateway.ticket import RouteRecord, RouteRequest, RouterStats, Ticket
from gpuhit.errors import ConfigError, NoInstanceError
from policies.snapshot import (
    ACTIONS,
    FETCH,
    FORWARD,
    MIGRATE,
    PD,
    Decision,
    InstanceState,
    RequestView,
    Snapshot,
)

ROLES = ("both", "prefill", "decode")
DEFAULT_KV_BYTES_PER_TOKEN = 98304
_NO_STATS = EngineStats()  # what a snapshot shows of engines whose stats are not used


class Router:
    """See the module docstring.

    ``roles`` (one of "both" / "prefill" / "decode" per engine) are passed to policies through the
    snapshot. ``unhealthy_after`` marks an instance unhealthy after that many consecutive errors
    (None: only explicit :meth:`mark_unhealthy`). ``clock`` replaces the running loop's time (for
    synchronous :meth:`decide` in tests).
    """

    def __init__(
        self,
        engines: Sequence[EngineClient],
        policy: Any,
        *,
        index: KVIndex,
        block_size: int = 16,
        roles: Sequence[str] | None = None,
        decision_sink: Callable[[RouteRecord], None] | None = None,
        clock: Callable[[], float] | None = None,
        kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN,
        unhealthy_after: int | None = None,
        use_engine_stats: bool = True,
    ):
        if not engines:
            raise ConfigError("the router needs at least one engine")
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        n = len(engines)
        if index.num_instances != n:
            raise ConfigError(f"KV index covers {index.num_instances} instances but {n} engines were given")
        roles = tuple(roles) if roles is not None else ("both",) * n
        if len(roles) != n or any(r not in ROLES for r in roles):
            raise ConfigError(f"roles must be {n} values among {ROLES}, got {list(roles)}")
        names = [e.name for e in engines]
        if len(set(names)) != n:
            raise ConfigError(f"engine names must be unique, got {names}")
        self.engines = tuple(engines)
        self.policy = policy
        self.policy_name = str(getattr(policy, "name", type(policy).__name__))
        # A policy that never reads prefix hits (round robin, least request, sticky) gets a snapshot
        # without them; only the chosen instances' hits are looked up, for the accounting. Matching
        # every instance is the costliest part of a snapshot when sessions are spread out.
        self._reads_hits = bool(getattr(policy, "reads_prefix_hits", True))
        # Only a policy that declares it gets the per-instance working-set sums (``reads_residency``)
        # and each ticket's prefill priced in work (``reads_prefill_work``); the others see 0 there.
        self._reads_residency = bool(getattr(policy, "reads_residency", False))
        self.prices_work = bool(getattr(policy, "reads_prefill_work", False))
        self.residency = SessionResidency()
        self.index = index
        # An index fed by the engines' events learns nothing from a forward (skipped per request).
        self._index_learns = getattr(index, "learns_from_routing", True)
        self.block_size = block_size
        self.roles = roles
        self.names = tuple(names)
        self.decision_sink = decision_sink
        self.kv_bytes_per_token = kv_bytes_per_token
        # The engines' stats (running, waiting, KV usage, capacity) go into snapshots only for a
        # policy that reads them: one that declares ``reads_engine_stats = False`` gets None there.
        self.use_engine_stats = use_engine_stats and bool(getattr(policy, "reads_engine_stats", True))
        # The injected clock itself (no wrapper call per read), else the running loop's.
        self.now: Callable[[], float] = clock if clock is not None else self._loop_time
        self.bindings = SessionBindings()
        self.stats = RouterStats(decisions_by_instance=[0] * n, errors_by_instance=[0] * n)
        # Late binding (gateway/hold.py): only for a policy with a hold rule.
        self.hold = HoldQueue(self.snapshot, policy.hold, self.stats) if getattr(policy, "holds", False) else None
        # Per-instance counters (gateway/share.py may swap in list subclasses that report each change).
        self._in_flight: list[int] = [0] * n
        self._routed: list[int] = [0] * n  # requests sent here so far, as target or as KV source (tie-break)
        self._pending: list[int] = [0] * n
        self._pending_work: list[int] = [0] * n  # the same prefills' time in token equivalents
        self._decode: list[int] = [0] * n
        self._active_blocks: list[int] = [0] * n
        # Health marks (gateway/instance_health.py); the lists are shared: snapshots read them as they are.
        health = self.health = InstanceHealth(n, unhealthy_after)
        self._healthy, self.unhealthy_reason, self._consecutive_errors = health.ok, health.reason, health.consecutive_errors
        self._seq = itertools.count()
        self._xfer = itertools.count()
        self._progress_ok = [accepts_on_progress(e) for e in engines]
        # engines that may hold KV events back (an emulated engine inside a decode jump) and
        # publish what is due when asked: asked before every index read, so decisions see them
        self._flushers = [f for f in (getattr(e, "flush_kv_events", None) for e in engines) if callable(f)]
        for i, eng in enumerate(engines):
            eng.subscribe_kv_events(self._kv_callback(i))

    # -- plumbing ----------------------------------------------------------------------------------

    def _kv_callback(self, i: int) -> Callable[[KVEventBatch], None]:
        index = self.index

        def on_batch(batch: KVEventBatch) -> None:
            index.on_kv_event(i, batch)

        return on_batch

    def _loop_time(self) -> float:
        """The router's time without an injected clock (``self.now``): the running loop's."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            raise ConfigError("Router.decide outside an event loop needs an injected clock") from None

    def _match_one(self, i: int, block_hashes: Sequence[int]) -> tuple[int, int]:
        """Instance ``i``'s (GPU, CPU) hit for ``block_hashes``, as :meth:`snapshot` matches it (after
        the engines have published what is due)."""
        self._flush()
        return self.index.match_one(i, block_hashes)

    def _flush(self) -> None:
        for flush in self._flushers:
            flush()

    def hit_tokens_of(self, i: int, req: RouteRequest) -> int:
        """Instance ``i``'s own GPU prefix hit for ``req`` now, in tokens, as vLLM serves it."""
        g, _ = self._match_one(i, req.block_hashes) if req.block_hashes else (0, 0)
        return min(g * self.block_size, max_cached_tokens(req.prompt_len, self.block_size))

    def _note_error(self, i: int, reason: str) -> None:
        self.stats.errors += 1
        self.stats.errors_by_instance[i] += 1
        self.health.failed(i, reason)

    # -- health ------------------------------------------------------------------------------------

    def mark_unhealthy(self, i: int, reason: str) -> None:
        self.health.mark_unhealthy(i, reason)

    def mark_healthy(self, i: int) -> None:
        self.health.mark_healthy(i)

    def healthy(self, i: int) -> bool:
        return self._healthy[i]

    # -- deciding ----------------------------------------------------------------------------------

    def snapshot(self, req: RouteRequest, with_hits: bool = True) -> Snapshot:
        """The frozen view the policy decides on (also used by debug endpoints).

        ``with_hits=False``: every instance's prefix hit is left 0 (for policies that do not read
        them, see ``reads_prefix_hits``).
        """
        if req.prompt_len <= 0 or req.max_tokens < 0:
            raise ConfigError(f"request {req.request_id}: prompt_len must be > 0 and max_tokens >= 0")
        bs = self.block_size
        if len(req.block_hashes) > req.prompt_len // bs:
            raise ConfigError(
                f"request {req.request_id}: {len(req.block_hashes)} block hashes but only "
                f"{req.prompt_len // bs} full blocks of {bs} tokens in a {req.prompt_len}-token prompt"
            )
        if not any(self._healthy):
            raise NoInstanceError("no healthy instance: every engine is marked unhealthy")
        n = len(self.engines)
        if with_hits:
            if self._flushers:  # engines holding KV events back publish what is due first
                self._flush()
            hits = self.index.match(req.block_hashes)
        else:
            hits = [(0, 0)] * n
        now = self.now()
        res = self.residency
        reads_residency = self._reads_residency
        resident, expected = res.working_sets(n, now, req.session_id) if reads_residency else ([0] * n,) * 2
        use_stats = self.use_engine_stats
        names, roles, healthy = self.names, self.roles, self._healthy
        in_flight, pending, decode, active, routed, work = (self._in_flight, self._pending, self._decode,
                                                            self._active_blocks, self._routed, self._pending_work)
        states = []
        for i, eng in enumerate(self.engines):
            st = eng.stats() if use_stats else _NO_STATS
            g, c = hits[i]
            states.append(InstanceState(i, names[i], roles[i], healthy[i], in_flight[i], pending[i], decode[i],
                                        active[i], st.running, st.waiting, st.kv_usage, st.kv_capacity_blocks, g, c,
                                        routed[i], resident[i], expected[i], work[i]))
        view = RequestView(req.request_id, req.prompt_len, len(req.block_hashes), bs, req.max_tokens,
                           req.session_id, req.parent_session, req.turn, next(self._seq))
        session = req.session_id
        # the observed service time (median, p90) and median prefill work, for the policies that read them
        obs = ((res.service_s, res.service_p90_s) if reads_residency else (None, None)) + (
            res.prefill_work_median if self.prices_work else None,)
        if session is None:  # no binding, migration or start to look up
            return Snapshot(now, view, tuple(states), None, None, None, *obs)
        b = self.bindings
        return Snapshot(now, view, tuple(states), b.get(session), b.last_migrated_at(session),
                        res.started_at(session), *obs)

    def decide(self, req: RouteRequest) -> Decision:
        """Snapshot + policy + validation (sync). Logs nothing and changes no counters."""
        return self._decide(req)[1]

    def _decide(self, req: RouteRequest) -> tuple[Snapshot, Decision]:
        snap = self.snapshot(req, self._reads_hits)
        d = self.policy.decide(snap)
        self._validate(d, snap)
        if not self._reads_hits and req.block_hashes:
            # the hits of the instances the decision involves, for the accounting in _begin
            insts = list(snap.instances)
            for i in {d.target, d.source} - {None}:
                g, c = self._match_one(i, req.block_hashes)
                insts[i] = msgspec.structs.replace(insts[i], gpu_hit_blocks=g, cpu_hit_blocks=c)
            snap = msgspec.structs.replace(snap, instances=tuple(insts))
        return snap, d

    def _validate(self, d: Decision, snap: Snapshot) -> None:
        n = len(self.engines)
        who = self.policy_name
        if not isinstance(d, Decision) or d.action not in ACTIONS:
            raise ConfigError(f"policy {who!r} returned an invalid decision {d!r}")
        if not (isinstance(d.target, int) and 0 <= d.target < n):
            raise ConfigError(f"policy {who!r} chose instance {d.target!r}, out of range 0..{n - 1}")
        if not self._healthy[d.target]:
            raise ConfigError(f"policy {who!r} chose unhealthy instance {d.target} ({self.names[d.target]})")
        if d.action != FORWARD:
            s = d.source
            if not (isinstance(s, int) and 0 <= s < n) or s == d.target:
                raise ConfigError(f"policy {who!r}: {d.action} needs a source instance other than the target, "
                                  f"got {s!r}")
            if not self._healthy[s]:
                raise ConfigError(f"policy {who!r} chose unhealthy source instance {s} ({self.names[s]})")

    # -- carrying out ------------------------------------------------------------------------------

    def begin(self, req: RouteRequest) -> Ticket:
        """Decide and account the request as routed (counters, binding, approximate index, log)."""
        snap, d = self._decide(req)
        return self._begin(req, snap, d)

    def begin_on(self, req: RouteRequest, target: int, reason: str) -> Ticket:
        """Account a request that must run on ``target`` (it names state only that engine holds,
        e.g. a stored response): no policy choice, the same bookkeeping and predicted hit as
        :meth:`begin`. An unhealthy target is a :class:`NoInstanceError` naming it."""
        self.health.check(target)
        if not self._healthy[target]:
            raise NoInstanceError(f"engine {self.names[target]} is unhealthy ({self.unhealthy_reason[target]}) "
                                  f"and {reason}")
        snap = self.snapshot(req, self._reads_hits)
        hit = snap.instances[target].gpu_hit_blocks
        if not self._reads_hits and req.block_hashes:
            hit = self._match_one(target, req.block_hashes)[0]
            insts = list(snap.instances)
            insts[target] = msgspec.structs.replace(insts[target], gpu_hit_blocks=hit)
            snap = msgspec.structs.replace(snap, instances=tuple(insts))
        return self._begin(req, snap, Decision(FORWARD, target, reason, predicted_hit_blocks=hit))

    def _begin(self, req: RouteRequest, snap: Snapshot, d: Decision) -> Ticket:
        t = Ticket(self, req, d, d.action, d.target, d.source)
        tgt, src = d.target, d.source
        inst = snap.instances
        if d.action == FORWARD:
            hit_blocks = inst[tgt].gpu_hit_blocks
        elif d.action == PD:
            hit_blocks = len(req.block_hashes)
        else:
            assert src is not None
            # The producer computes the whole prompt (what it does not hold yet) and the target
            # imports all of it, as for PD; the source's cached prefix only makes that step cheaper.
            t.producer_prefix_blocks = inst[src].gpu_hit_blocks
            hit_blocks = len(req.block_hashes)
            if t.producer_prefix_blocks == 0:  # nothing to move: policies should not ask for this
                raise ConfigError(
                    f"policy {self.policy_name!r}: {d.action} from instance {src}, which holds no prefix of "
                    f"request {req.request_id}"
                )
        if d.action == FORWARD:
            t.open(hit_blocks, self.block_size)
        else:
            assert src is not None
            t.open(hit_blocks, self.block_size, inst[src].gpu_hit_blocks, f"gpuhit-{next(self._xfer)}-{req.request_id}")
        # Knowledge updates.
        st = self.stats
        st.decisions += 1
        st.decisions_by_policy[self.policy_name] = st.decisions_by_policy.get(self.policy_name, 0) + 1
        st.decisions_by_instance[tgt] += 1
        st.actions[d.action] = st.actions.get(d.action, 0) + 1
        st.predicted_hit_tokens += t.predicted_hit_tokens
        session = req.session_id
        if session is not None:
            self.residency.on_arrival(session, snap.now)
            if d.action in (FORWARD, MIGRATE):
                self.residency.on_routed(session, tgt, t._blocks)
        if d.action == FORWARD:
            if session is not None:
                self.bindings.bind(session, tgt)
            if self._index_learns:
                self.index.on_routed(tgt, req.block_hashes)
        elif d.action == MIGRATE:
            st.migrations += 1
            self.bindings.migrated(req.session_id, tgt, snap.now)
            self.index.on_routed(tgt, req.block_hashes)
        elif d.action == FETCH:
            st.fetches += 1
            self.index.on_routed(tgt, req.block_hashes)
        else:
            st.pd_transfers += 1
            assert src is not None
            self.index.on_routed(src, req.block_hashes)
            self.index.on_routed(tgt, req.block_hashes)
        if self.decision_sink is not None:
            self.decision_sink(
                RouteRecord(
                    req.request_id, req.session_id, self.policy_name, d.action, tgt, src, d.reason,
                    d.scores, hit_blocks, snap.now,
                )
            )
        return t

    def begin_held(self, req: RouteRequest) -> Ticket | Coroutine[Any, Any, Ticket]:
        """:meth:`begin` after the hold queue lets ``req`` through: the ticket itself without a
        hold queue (no coroutine per request), else a coroutine of it (callers await a non-Ticket)."""
        return self.begin(req) if self.hold is None else self._begin_after_hold(req, self.hold)

    async def _begin_after_hold(self, req: RouteRequest, h: HoldQueue) -> Ticket:
        await h.admit(req)
        try:
            return self.begin(req)
        finally:
            h.routed()

    async def submit(self, req: RouteRequest) -> RoutedResult:
        """Route and run ``req`` in-process: (hold) -> begin -> (producer step) -> target -> finish
        (:func:`gateway.inprocess.run_routed`)."""
        return await run_routed(self, req, self._progress_ok)

    # -- introspection -----------------------------------------------------------------------------

    def counters(self) -> list[dict[str, int]]:
        """Per-instance gateway counters (for /debug/state and tests)."""
        return [{"in_flight": self._in_flight[i], "pending_prefill_tokens": self._pending[i],
                 "decode_seqs": self._decode[i], "active_blocks": self._active_blocks[i]}
                for i in range(len(self.engines))]
