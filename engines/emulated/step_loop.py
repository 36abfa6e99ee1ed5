"""The emulated engine's step loop: schedule, time the step, apply it; finish, abort and fail requests.

:class:`StepLoopMixin` is the half of :class:`engines.emulated.engine.EmulatedEngine` that runs
after a request is queued: the loop (:meth:`StepLoopMixin._run`) takes vLLM's schedule for one step
(:mod:`engines.emulated.scheduler`), sleeps for the profile's step time on the running loop's clock
(virtual or real), then applies the step (tokens, first-token and completion metrics, KV events).
Decode-only stretches go to :meth:`engines.emulated.decode_jump.DecodeJumpMixin._jump` instead. It
lives apart from the engine's request-facing half (:mod:`engines.emulated.engine`: construction,
``generate``, validation, stats, admin) because it is the part with the step-timing and completion
invariants, and it reads only the state listed under ``TYPE_CHECKING`` below.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from engines.base import GenerateResult
from engines.emulated.request import FINISHED, LOADING, WAITING, EmuRequest
from engines.emulated.scheduler import SchedulerOutput
from engines.kv_events import AllBlocksCleared, KVEventBatch

if TYPE_CHECKING:
    from collections.abc import Callable

    from engines.emulated.block_pool import BlockPool
    from engines.emulated.external_kv import ExternalKV
    from engines.emulated.kv_manager import KVCacheManager
    from engines.emulated.metrics import EngineMetrics
    from engines.emulated.profile import Profile
    from engines.emulated.scheduler import Scheduler
    from engines.emulated.shared_host import SharedHost
    from engines.emulated.stalls import StallSampler
    from engines.emulated.tiers import CPUTier


class StepLoopMixin:
    """The step loop of :class:`~engines.emulated.engine.EmulatedEngine` (see module docstring)."""

    if TYPE_CHECKING:  # provided by EmulatedEngine
        name: str
        bootstrap_addr: str
        scheduler: Scheduler
        kv: KVCacheManager
        pool: BlockPool
        profile: Profile
        metrics: EngineMetrics
        external: ExternalKV
        cpu: CPUTier | None
        jump_decode: bool
        host: SharedHost | None
        stalls: StallSampler | None
        last_error: BaseException | None
        _requests: dict[str, EmuRequest]
        _pending_aborts: list[EmuRequest]
        _subscribers: list[Callable[[KVEventBatch], None]]
        _waiter: asyncio.Future | None
        _last_time: float

        def _build_state(self) -> None: ...
        def _notify(self) -> None: ...
        def _all_decode(self, out: SchedulerOutput) -> bool: ...
        def _waiting_is_predictable(self) -> bool: ...
        async def _jump(self, out: SchedulerOutput, start: float) -> None: ...

    # ---- sleeping on the running loop's clock ------------------------------------------------------
    async def _wait(self, deadline: float | None) -> bool:
        """Sleep until notified or ``deadline``; True if notified first."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiter = fut
        handle = loop.call_at(deadline, _set_false, fut) if deadline is not None else None
        try:
            return await fut
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

    @staticmethod
    async def _sleep_until(when: float) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        handle = loop.call_at(when, _set_false, fut)
        try:
            await fut
        finally:
            handle.cancel()


    # ---- internals: step loop ------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        while True:
            try:
                now = self._last_time = loop.time()
                if self._pending_aborts:
                    self._process_aborts(now)
                if not sched.has_schedulable():
                    self._update_gauges()
                    self._publish(now)
                    await self._wait(None)
                    continue
                out = sched.schedule()
                if out.admitted:
                    for r in out.admitted:
                        if r.first_scheduled_time is None:  # a preempted request resumed keeps its first
                            r.first_scheduled_time = now
                if out.preempted:
                    self.metrics.num_preemptions += len(out.preempted)
                if out.started_loads:
                    self.external.start_loads(out.started_loads, now, self._load_done)
                if out.empty:
                    if out.preempted:
                        # The only running request was its own preemption victim: the step schedules
                        # nothing, but the next one differs (it admits from the waiting queue). vLLM's
                        # engine core steps again at once; waiting for a wake-up here could be forever.
                        continue
                    # nothing can run now (every waiting request loading, or blocked on pinned blocks)
                    if not sched.running and not sched.num_loading() and not self._has_pinned_blocks():
                        self._fail_stuck_head(now)
                        continue
                    self._update_gauges()
                    self._publish(now)
                    await self._wait(None)
                    continue
                if (
                    self.jump_decode
                    and not out.preempted
                    and not out.started_loads
                    and len(out.reqs) == len(sched.running)
                    and self._all_decode(out)
                    and (not sched.waiting or self._waiting_is_predictable())
                ):
                    await self._jump(out, now)
                    continue
                prefill = 0.0
                dsum = 0
                prof = self.profile
                for r, n, c in zip(out.reqs, out.num_tokens, out.contexts):
                    if n == 1 and r.num_output_tokens > 0:
                        dsum += c
                    else:
                        prefill += prof.prefill_cost(n, c)
                step = prof.step_time(len(out.reqs), prefill, dsum)
                factor = None
                if self.host is not None:  # engines sharing a host's cores slow each other down
                    # the tokens this step produces: every sequence whose last prompt chunk or decode it runs
                    gen = sum(1 for r, n in zip(out.reqs, out.num_tokens) if r.num_computed_tokens + n >= r.num_tokens)
                    factor = self.host.factor(self, now, gen, step)
                    step *= factor
                if self.stalls is not None:  # the host preempts the worker mid-step (engines.emulated.stalls)
                    step = self.stalls.step(step, factor)
                end = now + step
                await self._sleep_until(end)
                self._apply(out, now, end)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - never leave a request hanging on an engine bug
                self.last_error = exc
                self._fail_all(exc)
                sched = self.scheduler  # _fail_all built a fresh one

    def _has_pinned_blocks(self) -> bool:
        """Whether finished PD producers still hold blocks here (registered, leased, or claimed by a
        consumer whose load is in flight). They come back by themselves, on the consumer's load
        timer or the registry's expiry timer, and wake the step loop when they do."""
        live = self._requests
        return any(rid not in live for rid in self.kv.req_blocks)

    def _fail_stuck_head(self, now: float) -> None:
        """Last line of defence against a hang: nothing runs, loads or is pinned, yet the head of
        the queue cannot be scheduled, so no event will ever change that (arrivals queue behind
        it). The scheduler is built so this cannot happen (every request fits the empty pool; see
        ``Scheduler._unblock``); if it does, the head finishes with an error instead of waiting
        forever, and the next one gets its turn."""
        head = self.scheduler.waiting[0]
        self.scheduler.remove(head)
        self._finish(head, now, (
            f"emulated engine {self.name!r} could not schedule request {head.request_id!r} "
            f"({head.prompt_len} prompt tokens, {self.pool.free_queue.num_free} of {self.pool.num_usable} "
            "KV blocks free, nothing running): failed instead of waiting forever"))
        self._update_gauges()
        self._publish(now)

    def _apply(self, out: SchedulerOutput, start: float, end: float) -> None:
        m = self.metrics
        m.add_busy(start, end)
        m.num_steps += 1
        finished = []
        gen = 0
        for r, n in zip(out.reqs, out.num_tokens):
            r.num_computed_tokens += n
            if r.num_computed_tokens < r.num_tokens:
                continue  # a prefill chunk that is not the last one
            r.num_output_tokens += 1
            if r.output_chain is not None:
                r.output_chain.extend(r)
            gen += 1
            if r.first_token_time is None:
                r.first_token_time = end
                self._on_first_token(r, end)
            else:
                m.itl.observe(end - r.last_token_time)
            r.last_token_time = end
            if r.num_output_tokens >= r.max_tokens:
                finished.append(r)
            elif r.on_progress is not None:
                r.on_progress(r.num_output_tokens)
        m.generation_tokens += gen
        if finished:
            self._complete(finished, end)
        self._update_gauges()
        self._publish(end)

    def _on_first_token(self, r: EmuRequest, t: float) -> None:
        m = self.metrics
        m.ttft.observe(t - r.arrival)
        if r.first_scheduled_time is not None:
            m.prefill_time.observe(t - r.first_scheduled_time)
        m.prompt_tokens += r.prompt_len
        local = max(r.cached_tokens, 0)
        ext = r.external_tokens
        src = m.prompt_tokens_by_source
        src["local_cache_hit"] += local
        src["external_kv_transfer"] += ext
        src["local_compute"] += r.prompt_len - local - ext

    # ---- internals: completion -----------------------------------------------------------------
    def _complete(self, finished: list[EmuRequest], t: float) -> None:
        done = set(map(id, finished))
        self.scheduler.running = [r for r in self.scheduler.running if id(r) not in done]
        for r in finished:
            if r.on_progress is not None:
                r.on_progress(r.num_output_tokens)
            self._finish(r, t, None)

    def _finish(self, r: EmuRequest, t: float, error: str | None) -> None:
        """Resolve the request's future; free (or, for a PD producer, pin) its blocks."""
        if r.status == FINISHED:
            return
        self._requests.pop(r.request_id, None)
        m = self.metrics
        if error is None and r.is_producer:
            def release(r: EmuRequest = r) -> None:
                self.kv.free(r)
                self._notify()

            self.external.pin_for_transfer(r, self.name, self.bootstrap_addr, tuple(self.kv.block_ids(r)), release)
        else:
            if r.status == LOADING and r.load_release is not None:
                r.load_release()
                r.load_release = None
            self.kv.free(r)
        r.status = FINISHED
        r.finish_time = t
        if error is None:
            m.request_success += 1
            m.e2e.observe(t - r.arrival)
            if r.queued_time is not None and r.first_scheduled_time is not None:
                m.queue_time.observe(r.first_scheduled_time - r.queued_time)
            if r.first_token_time is not None:
                m.decode_time.observe(t - r.first_token_time)
        else:
            m.request_errors += 1
        res = GenerateResult(
            request_id=r.request_id, prompt_tokens=r.prompt_len, completion_tokens=r.num_output_tokens,
            cached_tokens=max(r.cached_tokens, 0), external_cached_tokens=r.external_tokens,
            arrival=r.arrival, first_token_time=r.first_token_time, finish_time=t, error=error,
            kv_transfer_params=r.result_params, num_preemptions=r.num_preemptions,
            queued_time=r.queued_time, scheduled_time=r.first_scheduled_time,
        )
        fut = r.future
        if fut is not None and not fut.done():
            fut.set_result(res)

    def _process_aborts(self, now: float) -> None:
        aborts, self._pending_aborts = self._pending_aborts, []
        for r in aborts:
            if r.status == FINISHED:
                continue
            if r.queued_time is None:  # still in the frontend
                self._finish(r, now, "aborted")
                continue
            self.scheduler.remove(r)
            self._finish(r, now, "aborted")
        self._update_gauges()
        self._publish(now)

    def _fail_all(self, exc: BaseException) -> None:
        now = self._last_time
        msg = f"emulated engine {self.name!r} failed in its step loop: {exc!r}"
        victims = list(self._requests.values())
        # the KV state may be inconsistent after a bug: start from an empty cache
        self._build_state()
        for r in victims:
            self._requests.pop(r.request_id, None)
            r.status = FINISHED
            r.load_release = None  # its blocks belong to the discarded pool
            res = GenerateResult(request_id=r.request_id, prompt_tokens=r.prompt_len,
                                 completion_tokens=r.num_output_tokens, arrival=r.arrival,
                                 first_token_time=r.first_token_time, finish_time=now, error=msg)
            self.metrics.request_errors += 1
            if r.future is not None and not r.future.done():
                r.future.set_result(res)
        if self._subscribers:
            self._deliver(KVEventBatch(ts=now, events=(AllBlocksCleared(),)))

    # ---- internals: external KV (the loads ExternalKV started) -------------------------------------
    def _load_done(self, r: EmuRequest) -> None:
        if r.status != LOADING:
            return  # aborted (or failed) meanwhile
        r.status = WAITING  # keeps its place in the queue
        self.kv.cache_blocks(r, r.num_computed_tokens)
        if r.load_release is not None:
            r.load_release()
            r.load_release = None
        r.load_hit = None
        self._publish(asyncio.get_running_loop().time())
        self._notify()

    # ---- internals: observability --------------------------------------------------------------
    def _update_gauges(self) -> None:
        m = self.metrics
        s = self.kv.stats
        m.num_requests_running = len(self.scheduler.running)
        m.num_requests_waiting = len(self.scheduler.waiting)
        m.kv_cache_usage_perc = self.pool.usage()
        m.prefix_cache_queries = s.queries
        m.prefix_cache_hits = s.hits

    def _publish(self, ts: float) -> None:
        if not self._subscribers:
            return
        events = self.pool.take_events()
        if self.cpu is not None and self.cpu.events:
            events.extend(self.cpu.take_events())
        if events:
            self._deliver(KVEventBatch(ts=ts, events=tuple(events)))

    def _deliver(self, batch: KVEventBatch) -> None:
        for cb in self._subscribers:
            cb(batch)


def _set_false(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)

