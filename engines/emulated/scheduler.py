"""The step scheduler: vLLM v1's unified token-budget schedule, FCFS or priority, chunked prefill, preemption.

One call to :meth:`Scheduler.schedule` decides one engine step, exactly as vLLM's
``Scheduler.schedule`` does for a single full-attention KV group without speculative decoding:

1. Running requests first, in order: each gets ``min(remaining, budget)`` tokens (1 when decoding,
   the next chunk when its prefill was chunked). If its slots cannot be allocated, the *last*
   running request (priority policy: the lowest priority, latest arrival) is preempted (blocks
   freed, computed tokens reset, back to the front of the waiting queue, or to its place in
   priority order) and allocation retried; if the victim is the request itself it is not scheduled.
2. Only if nothing was preempted in this step: waiting requests in queue order (FCFS, or
   priority, arrival, id) while the budget lasts and fewer than ``max_num_seqs`` run; without
   chunked prefill a prompt longer than the budget left stops the loop; a request is admitted
   only if blocks for its whole sequence fit (vLLM 0.32's ``scheduler_reserve_full_isl``), and
   its prefix lookup is counted in the stats then. A fresh request first takes its local prefix hit,
   then asks ``external_lookup`` for more (CPU tier, remote store, PD transfer); a request with an
   external hit only reserves blocks and waits for the load (status LOADING), like vLLM's
   WAITING_FOR_REMOTE_KVS. The first waiting request that cannot get blocks stops the loop.

One departure from vLLM, for liveness only: a request whose external KV has landed keeps its
blocks while it waits for its turn, so with strict FCFS a head request that needs those blocks
(a preempted or fresh request queued ahead of it) waits for them forever while the holder waits
for the head: nothing runs and nothing will (a PD decode instance hung this way). When the head
cannot get blocks *and nothing is running*, :meth:`Scheduler._unblock` lets a landed holder go
first (or, if the head is itself a holder short of a block, frees another holder's blocks as a
preemption). With anything running, FCFS is kept exactly: finishing requests free blocks.

Token bookkeeping (``num_computed_tokens`` += scheduled, a sampled token when the prompt is fully
computed) happens in the engine after the step's duration has elapsed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.emulated.block_ids import NO_BLOCKS
from engines.emulated.kv_manager import KVCacheManager
from engines.emulated.request import LOADING, RUNNING, WAITING, EmuRequest
from gpuhit.errors import ConfigError

#: vLLM's ``--scheduling-policy`` values
POLICIES = ("fcfs", "priority")


def _victim_key(r: EmuRequest) -> tuple[int, float]:
    return (r.priority, r.arrival)


@dataclass(slots=True)
class ExternalHit:
    """KV found outside the local GPU cache for the blocks after the local hit."""

    tokens: int
    load_seconds: float
    cpu_blocks: int = 0
    remote_blocks: int = 0
    transfer_blocks: int = 0
    nbytes: int = 0
    transfer_id: str | None = None  # PD transfer to claim when the load starts


@dataclass(slots=True)
class SchedulerOutput:
    reqs: list[EmuRequest] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    contexts: list[int] = field(default_factory=list)
    preempted: list[EmuRequest] = field(default_factory=list)
    started_loads: list[EmuRequest] = field(default_factory=list)
    admitted: list[EmuRequest] = field(default_factory=list)  # first scheduling of these requests

    @property
    def empty(self) -> bool:
        return not self.reqs


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        external_lookup: Callable[[EmuRequest, int], ExternalHit | None] | None = None,
        policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        reserve_full_isl: bool = True,
    ):
        if policy not in POLICIES:
            raise ConfigError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.priority = policy == "priority"
        self.enable_chunked_prefill = enable_chunked_prefill
        self.reserve_full_isl = reserve_full_isl
        self.external_lookup = external_lookup
        self.waiting: deque[EmuRequest] = deque()
        self.running: list[EmuRequest] = []
        self.num_preemptions = 0

    def add(self, req: EmuRequest) -> None:
        req.status = WAITING
        if self.priority:
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)

    def _insert_by_priority(self, req: EmuRequest) -> None:
        """Keep the waiting queue in vLLM's heap order (priority, arrival, request id).

        vLLM's priority queue is a heap whose pops (and iteration) follow that total order, and
        its "prepend" (a preempted or skipped request) is a plain push; a queue kept sorted gives
        the same order, and leaves ``waiting[0]`` the next request as in FCFS.
        """
        key = req.sort_key()
        waiting = self.waiting
        for i, r in enumerate(waiting):
            if key < r.sort_key():
                waiting.insert(i, req)
                return
        waiting.append(req)

    def has_schedulable(self) -> bool:
        if self.running:
            return True
        for r in self.waiting:
            if r.status != LOADING:
                return True
        return False

    def num_loading(self) -> int:
        return sum(1 for r in self.waiting if r.status == LOADING)

    def _preempt(self, req: EmuRequest) -> None:
        self.kv.free(req)
        req.status = WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.priority:
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = req.num_tokens - req.num_computed_tokens
            n = min(n, budget)
            if n <= 0:  # cannot happen without speculative decoding; keep vLLM's guard
                i += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(req, n)
                if new_blocks is not None:
                    break
                if self.priority:
                    # the lowest priority, latest arrival (max() keeps the first of equals)
                    victim = max(running, key=_victim_key)
                    v = running.index(victim)
                    del running[v]
                    if v < i:
                        i -= 1
                        # scheduled earlier in this step: its tokens go back to the budget
                        j = out.reqs.index(victim)
                        budget += out.num_tokens[j]
                        del out.reqs[j], out.num_tokens[j], out.contexts[j]
                else:
                    victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                break
            out.reqs.append(req)
            out.num_tokens.append(n)
            out.contexts.append(req.num_computed_tokens)
            budget -= n
            i += 1

        if out.preempted:
            return out

        waiting = self.waiting
        skipped: list[EmuRequest] = []
        while waiting and budget > 0:
            if len(running) >= self.max_num_seqs:
                break
            req = waiting[0]
            if req.status == LOADING:
                skipped.append(waiting.popleft())
                continue
            ext: ExternalHit | None = None
            if req.num_computed_tokens == 0:
                hit_blocks, n_local = kv.get_computed_blocks(req)
                if self.external_lookup is not None:
                    ext = self.external_lookup(req, n_local)
            else:  # its external KV has landed: continue from there
                hit_blocks, n_local = NO_BLOCKS, 0
            num_computed = req.num_computed_tokens + n_local
            if ext is not None:
                n_new = 0
                alloc_tokens = ext.tokens
            else:
                n_new = req.num_tokens - num_computed
                if n_new > budget and not self.enable_chunked_prefill:
                    break  # vLLM without chunked prefill: the prompt waits for a whole budget
                n_new = min(n_new, budget)
                alloc_tokens = n_new
            new_blocks = kv.allocate_slots(req, alloc_tokens, n_local, hit_blocks,
                                           delay_cache_blocks=ext is not None,
                                           full_sequence_must_fit=self.reserve_full_isl)
            if new_blocks is None:
                if not running and self._unblock(req, out):
                    continue
                break
            if req.num_computed_tokens == 0:
                kv.record_admission(req, n_local)
            waiting.popleft()
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = n_local
                req.external_tokens = ext.tokens if ext is not None else 0
                out.admitted.append(req)
            if ext is not None:
                req.status = LOADING
                req.num_computed_tokens = num_computed + ext.tokens
                req.load_seconds = ext.load_seconds
                req.load_hit = ext
                out.started_loads.append(req)
                skipped.append(req)
                continue
            req.status = RUNNING
            running.append(req)
            req.num_computed_tokens = num_computed
            out.reqs.append(req)
            out.num_tokens.append(n_new)
            out.contexts.append(num_computed)
            budget -= n_new
        if skipped:
            if self.priority:
                for r in skipped:
                    self._insert_by_priority(r)
            else:
                waiting.extendleft(reversed(skipped))
        return out

    def blocked_head(self) -> EmuRequest | None:
        """The waiting request a schedule would try first (LOADING ones are passed over)."""
        for r in self.waiting:
            if r.status != LOADING:
                return r
        return None

    def _unblock(self, head: EmuRequest, out: SchedulerOutput) -> bool:
        """``head`` cannot get blocks and nothing runs: break the wait on landed KV (see the module
        docstring). True if the queue changed and scheduling should retry.

        Every request fits the empty pool (the engine validates that), so with nothing running
        the blocks ``head`` lacks are held by loads in flight (they land by themselves) or by
        landed requests waiting behind it. A head holding nothing lets the first landed holder go
        first (it needs at most one more block: its KV is there); a head that is itself a landed
        holder short of a block frees the *last* other holder's blocks (vLLM's victim order), which
        stay cached, so that request gets them back as a local hit. Terminates: promoting happens
        only for a head holding nothing and is followed by a holder at the head; freeing removes a
        holder each time.
        """
        waiting = self.waiting
        holders = [r for r in waiting if r is not head and r.status == WAITING and r.num_computed_tokens > 0]
        if not holders:
            return False
        if head.num_computed_tokens == 0:
            first = holders[0]
            waiting.remove(first)
            waiting.appendleft(first)
            return True
        victim = holders[-1]
        self.kv.free(victim)
        victim.num_computed_tokens = 0  # keeps its place in the queue, recomputes from its local hit
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim)
        return True

    def remove(self, req: EmuRequest) -> None:
        """Take a request out of the queues (finished, aborted or failed); frees nothing."""
        if req.status == RUNNING:
            try:
                self.running.remove(req)
            except ValueError:
                pass
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
