"""Decode jumps of the emulated engine: a decode-only stretch advanced in one step of the loop.

Decode-only stretches (every running request decoding, nothing admitted) are advanced in
one jump to the first completion: the batch is fixed, so step ``j`` lasts
``step_time(n, 0, sum_ctx + n*(j-1))`` and all step ends are known up front. The jump is
interrupted by anything that changes the queues (an arrival, an abort): at time ``t`` the engine
finishes the step in flight, applies the steps completed so far and resumes step by step, so a
jump gives the same per-request token times as stepping (``jump_decode=False``) bit for bit.
Block allocations inside a jump are replayed in vLLM's order (step, then running order), and a
jump stops before the first step whose allocation could fail, so preemption happens as stepping
would do it.

Requests may wait during a stretch (under load they nearly always do: the head of the queue is
short of KV blocks): the jump plans, from the free queue, the step at which the head would be
admitted and stops before it, and counts the head's per-step lookups as vLLM would
(:meth:`EmulatedEngine._blocked_plan`). Observers see the stretch as if stepped:
:meth:`EmulatedEngine.flush_kv_events` (called by the router before it reads its KV index)
publishes the events of the steps that have ended. A whole simulated replay gives the same records
with and without jumps (``tests/replayer/test_jump_equivalence.py``); on a saturated cluster the
jumps cut the steps executed one by one about twelvefold.

:class:`DecodeJumpMixin` holds that machinery; :class:`engines.emulated.engine.EmulatedEngine` mixes it
in and calls :meth:`DecodeJumpMixin._jump` from its step loop. It lives apart because it is the one
part of the engine with its own invariants (bit-identical to stepping), tested on its own
(``tests/engines/emulated/test_fast_paths.py``, ``tests/replayer/test_jump_equivalence.py``).
"""

from __future__ import annotations

import asyncio
import bisect
from typing import TYPE_CHECKING

import numpy as np

from engines.emulated.block_ids import distinct, positions
from engines.emulated.kv_manager import cdiv
from engines.emulated.request import EmuRequest
from engines.emulated.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from engines.emulated.block_pool import BlockPool
    from engines.emulated.kv_manager import KVCacheManager
    from engines.emulated.metrics import EngineMetrics
    from engines.emulated.profile import Profile
    from engines.emulated.scheduler import Scheduler


class Allocations:
    """The block allocations of a decode stretch's steps 2..k, in vLLM's order (step, then running
    order): allocation ``i`` gives ``owner[i]`` (an index into the batch) one block at step ``step[i]``.

    Why arrays: a stretch of long decodes allocates a block per request every ``block_size`` steps;
    built, searched and applied as arrays, the stretch costs a few numpy calls instead of a Python
    tuple, a comparison and a one-block pool allocation per block.
    """

    __slots__ = ("owner", "step")

    def __init__(self, step: np.ndarray, owner: np.ndarray):
        self.step = step
        self.owner = owner

    @classmethod
    def of_stretch(cls, computed: list[int], block_size: int, k: int) -> Allocations:
        """Allocations of steps 2..k for requests with these computed tokens (one decode per step:
        a request needs a new block at the step whose token starts one)."""
        if k < 2:
            return cls(_NONE, _NONE)
        if len(computed) * (k // block_size + 1) <= 64:
            # a few allocations: the definition itself, cheaper than a dozen numpy calls
            pairs = sorted((j, idx) for idx, c in enumerate(computed)
                           for j in range(_first_step(c, block_size), k + 1, block_size))
            return cls(np.array([j for j, _ in pairs], np.int64), np.array([i for _, i in pairs], np.int64))
        c = np.asarray(computed, np.int64)
        first = 1 + (-c) % block_size  # the step of the first block it starts
        first[first == 1] += block_size  # step 1's allocation was made when it was scheduled
        count = np.maximum((k - first) // block_size + 1, 0)
        total = int(count.sum())
        if not total:
            return cls(_NONE, _NONE)
        owner = np.repeat(np.arange(len(c)), count)
        starts = np.cumsum(count) - count
        step = np.repeat(first, count) + block_size * (np.arange(total) - np.repeat(starts, count))
        order = np.lexsort((owner, step))
        return cls(step[order], owner[order])

    def __len__(self) -> int:
        return len(self.step)

    def upto(self, j: int) -> int:
        """How many allocations belong to steps <= ``j``."""
        return int(np.searchsorted(self.step, j, "right"))


_NONE = np.empty(0, np.int64)


def _hit_pops(pool: BlockPool, hit: np.ndarray, zpos: np.ndarray, made: np.ndarray
              ) -> tuple[list[int], list[int], list[int]]:
    """The decode allocations of a stretch that pop one of the waiting head's evictable hit blocks
    ``hit[zpos]``: per such pop, in popping order, the step index (0 = step 2) whose allocations
    make it, the block, and its first position in ``hit``.

    Why arrays: a stretch pops thousands of free blocks and the head's hit holds thousands; only the
    few pops that meet the hit matter, so membership is one pass over the popped ids (the pool's
    scratch array maps each hit block to a position in ``hit[zpos]``; a stale entry fails the
    check ``hit[zpos][slot] == block``) instead of a dict probe per popped block.
    """
    n_pop = int(made[-1])
    if not n_pop:
        return [], [], []
    order = pool.free_queue.peek(n_pop)
    cand = hit[zpos]
    m = len(cand)
    scratch = pool._mark
    unique = distinct(cand, scratch)
    scratch[cand] = positions(m)
    slot = np.minimum(scratch[order], m - 1)
    met = np.flatnonzero(cand[slot] == order)
    if not len(met):
        return [], [], []
    nodes = order[met]
    if unique:
        pos = zpos[slot[met]].tolist()
    else:  # a block listed twice (hashes that are not chained): its first position
        pos = [int(zpos[np.flatnonzero(cand == b)[0]]) for b in nodes.tolist()]
    steps = np.searchsorted(made, met, "right")  # pop p is made by the first step with made > p
    return steps.tolist(), nodes.tolist(), pos


def _first_step(computed: int, block_size: int) -> int:
    """The step (from 1) whose decode starts a new block, after step 1 (allocated when scheduled)."""
    j0 = 1 + (-computed) % block_size
    return j0 + block_size if j0 == 1 else j0


class DecodeJumpMixin:
    """The decode-jump half of :class:`~engines.emulated.engine.EmulatedEngine` (see module docstring).

    ``_jump_state`` is ``[reqs, Allocations, step ends, start, allocations made]`` while a jump is in flight.
    """

    if TYPE_CHECKING:  # provided by EmulatedEngine
        scheduler: Scheduler
        kv: KVCacheManager
        pool: BlockPool
        profile: Profile
        metrics: EngineMetrics
        block_size: int
        max_num_seqs: int
        max_num_batched_tokens: int
        cpu: object
        remote: object
        _jump_state: list | None
        num_jumps: int
        num_interrupted_jumps: int

        def _publish(self, ts: float) -> None: ...
        def _apply(self, out: SchedulerOutput, start: float, end: float) -> None: ...
        def _complete(self, finished: list[EmuRequest], t: float) -> None: ...
        def _update_gauges(self) -> None: ...
        async def _sleep_until(self, when: float) -> None: ...
        async def _wait(self, deadline: float | None) -> bool: ...

    def flush_kv_events(self) -> None:
        """Bring a decode jump in flight up to the present for observers (the router calls this
        before it reads the KV index): make the block allocations of the steps that have ended and
        publish their KV events, as stepping would have by now.

        Why: a jump applies its steps at its end, so without this a router deciding mid-jump would
        see the index as of the jump's start; the evictions that the decodes' new blocks cause
        would reach it late and routing would differ from a step-by-step run. Timing is untouched:
        only state that stepping would already have published is changed earlier. (Stepping makes
        a step's allocations when the step starts; nothing reads them before it ends, except the
        KV-usage gauge, which lags here by at most one step.)
        """
        js = self._jump_state
        if js is None:
            return
        reqs, allocs, ends, _, done = js
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            return
        ended = bisect.bisect_right(ends, now)  # steps 1..ended are over
        if not ended:
            return
        upto = allocs.upto(ended)
        if upto > done:
            self.kv.append_blocks(reqs, allocs.owner[done:upto])
            js[4] = upto
        if self.pool.events:  # step 1's allocations (made when it was scheduled) and the above
            self._publish(float(ends[ended - 1]))

    def _waiting_is_predictable(self) -> bool:
        """Whether a decode stretch can be jumped over with requests waiting (see ``_blocked_plan``).

        The waiting head's fate must depend only on this pool: no CPU tier or remote store (whose
        contents change without notice as evictions land there) and no consumer whose PD transfer
        is still to be looked up (the registry changes without notice too). LOADING requests are
        passed over by the scheduler; their landing wakes the step loop, which ends the jump.
        """
        if self.cpu is not None or self.remote is not None:
            return False
        head = self.scheduler.blocked_head()
        if head is None:
            return True
        params = head.kv_transfer_params
        return not (params and params.get("do_remote_prefill") and not head.transfer_tried)

    def _blocked_plan(self, n_decodes: int, allocs: Allocations, k: int
                      ) -> tuple[int, tuple[EmuRequest, list[int]] | None]:
        """How many steps of a decode stretch the waiting head stays blocked, and its lookups' hits.

        Stepping, each step of the stretch would first allocate the decodes' blocks, then look the
        head's prefix up (vLLM counts every lookup in its prefix-cache stats) and fail to allocate
        it. Nothing frees blocks during the stretch (a completion ends it, a release or an abort
        wakes the loop), so only the decodes' allocations change the head's outlook: the a-th one
        pops the a-th block of the free queue, which may be one of the head's cached prefix blocks
        and cut its hit there. Walking those blocks gives, per step j, the hit and whether
        ``new blocks + evictable hit blocks > free blocks`` still holds (the same test as
        :meth:`KVCacheManager.allocate_slots`). A shorter hit can let a *chunked* prefill fit
        (its new blocks are capped by the budget while fewer hit blocks count as evictable), so
        the stretch ends before the first step where the head would be admitted. Returns
        ``(k', (head, hits))``: ``hits[j - 2]`` is the hit in tokens of the head's lookup in step j,
        for j = 2..k'; None instead of the pair when the head is not looked up (max_num_seqs
        reached, no budget, a landed head).
        """
        sched = self.scheduler
        budget = self.max_num_batched_tokens - n_decodes
        head = sched.blocked_head()
        if head is None or len(sched.running) >= self.max_num_seqs or budget <= 0:
            return k, None
        if head.num_computed_tokens != 0:
            # landed KV: no lookup, a fixed number of new blocks, and free blocks only shrink
            return k, None
        kv = self.kv
        bs = self.block_size
        hit = kv._last_blocks if kv._last_req is head else kv.longest_hit(head.block_hashes, (head.num_tokens - 1) // bs)
        n_hit = len(hit)
        pool = self.pool
        zero = pool.ref_cnt[hit] == 0
        zpos = np.flatnonzero(zero)  # positions of the evictable hit blocks (only those can be popped)
        evictable = len(zpos)
        free0 = pool.free_queue.num_free
        num_tokens = head.num_tokens
        # per step j = 2..k: the allocations of steps <= j (the free queue pops them before the lookup)
        made = np.searchsorted(allocs.step, positions(k + 1)[2:], "right")
        n_steps = k - 1
        # The head's state changes only where a decode allocation pops one of its evictable hit
        # blocks: those pops are the events, (step index, block, its first position in the hit).
        ev_t: list[int] = []
        ev_node: list[int] = []
        ev_pos: list[int] = []
        if evictable:
            ev_t, ev_node, ev_pos = _hit_pops(pool, hit, zpos, made)
        dups = pool._dups
        hits: list[int] = []
        # Between events the head's hit and evictable count are fixed while the free blocks only
        # shrink, so the admission test can first pass at a segment's first step or not at all.
        t, e, n_ev = 0, 0, len(ev_t)
        while True:
            while e < n_ev and ev_t[e] == t:  # step t + 2's decode allocations pop these
                node = ev_node[e]
                if dups and pool.block_hash.item(node) in dups:
                    # a duplicate takes over the hash and the hit goes on with another block,
                    # whose reference count this plan does not follow: step from here instead
                    return t + 1, (head, hits)
                i = ev_pos[e]
                if i < n_hit:
                    n_hit = i
                    evictable = int(np.searchsorted(zpos, i))  # evictable hit blocks before i
                e += 1
            seg_end = ev_t[e] if e < n_ev else n_steps
            n_local = n_hit * bs
            # not chunked and longer than a budget: the prompt waits for a whole budget
            if sched.enable_chunked_prefill or num_tokens - n_local <= budget:
                if sched.reserve_full_isl:  # vLLM's admission gate: blocks for every token
                    n_new = cdiv(num_tokens, bs) - n_hit
                else:
                    n_new = cdiv(n_local + min(num_tokens - n_local, budget), bs) - n_hit
                if n_new + evictable <= free0 - int(made[t]):
                    return t + 1, (head, hits)  # the head would be admitted at step t + 2: stop before it
            hits.extend([n_local] * (seg_end - t))
            t = seg_end
            if t >= n_steps:
                return k, (head, hits)

    @staticmethod
    def _all_decode(out: SchedulerOutput) -> bool:
        for r, n in zip(out.reqs, out.num_tokens):
            if n != 1 or r.num_output_tokens == 0 or r.num_tokens - r.num_computed_tokens != 1:
                return False
        return True

    async def _jump(self, out: SchedulerOutput, start: float) -> None:
        reqs = out.reqs
        n = len(reqs)
        bs = self.block_size
        k_complete = min(r.max_tokens - r.num_output_tokens for r in reqs)
        allocs = Allocations.of_stretch([r.num_computed_tokens for r in reqs], bs, k_complete)
        k = k_complete
        free = self.pool.free_queue.num_free
        if len(allocs) > free:
            k = int(allocs.step[free]) - 1
        if self.kv.enable_caching:
            # A request whose generated tokens are known caches each block its decodes fill, in
            # the allocation of the step after (a BlockStored between that step's evictions, as
            # vLLM orders them). The jump stops before the first such step; stepping does it.
            for r in reqs:
                if r.output_chain is not None:
                    j_fill = (-r.num_computed_tokens) % bs
                    k = min(k, (j_fill if j_fill >= 2 else j_fill + bs) - 1)
        if k >= 2 and self.scheduler.waiting:
            k, _ = self._blocked_plan(n, allocs, k)
        if k < 2:
            # nothing to jump over: one ordinary step
            dsum = sum(out.contexts)
            end = start + self.profile.step_time(n, 0.0, dsum)
            await self._sleep_until(end)
            self._apply(out, start, end)
            return
        ends = self.profile.decode_step_ends(start, n, sum(out.contexts), k)
        self._jump_state = [reqs, allocs, ends, start, 0]
        timers = self._per_step_progress(reqs, ends)
        last = float(ends[-1])
        try:
            interrupted = await self._wait(last)
        except BaseException:
            self._jump_state = None
            raise
        finally:
            for h in timers:
                h.cancel()
        self.num_jumps += 1
        m = k
        if interrupted:
            self.num_interrupted_jumps += 1
            now = asyncio.get_running_loop().time()
            if now < last:
                m = bisect.bisect_left(ends, now) + 1
                if ends[m - 1] > now:
                    await self._sleep_until(float(ends[m - 1]))
        self._apply_jump(reqs, m, ends, start, allocs)

    @staticmethod
    def _per_step_progress(reqs: list[EmuRequest], ends: list[float] | np.ndarray) -> list[asyncio.TimerHandle]:
        """Report each jumped-over step's token at that step's end to the progress callbacks that ask
        for it (``per_step``: a streaming HTTP client, which vLLM sends one chunk per token at its
        step time); a jump otherwise reports its tokens at once, at its end. The step that ends the
        jump is reported by :meth:`_apply_jump`, so callbacks past an interruption are cancelled."""
        loop = asyncio.get_running_loop()
        timers = []
        for r in reqs:
            cb = r.on_progress
            if cb is not None and getattr(cb, "per_step", False):
                base = r.num_output_tokens
                at = ends[:-1].tolist() if isinstance(ends, np.ndarray) else ends[:-1]
                timers.extend(loop.call_at(t, cb, base + j) for j, t in enumerate(at, 1))
        return timers

    def _apply_jump(self, reqs: list[EmuRequest], m: int, ends: list[float] | np.ndarray, start: float,
                    allocs: Allocations) -> None:
        done = 0
        if self._jump_state is not None:
            done = self._jump_state[4]  # allocations a catch-up already made
            self._jump_state = None
        upto = allocs.upto(m)
        if upto > done:
            self.kv.append_blocks(reqs, allocs.owner[done:upto])
        met = self.metrics
        end = float(ends[m - 1])
        met.add_busy(start, end)
        met.num_steps += m
        n = len(reqs)
        itl = met.itl
        first = float(ends[0])
        for r in reqs:
            itl.observe(first - r.last_token_time)
        if m > 1:
            itl.observe_gaps(ends[:m], n)
        finished = []
        for r in reqs:
            r.num_computed_tokens += m
            r.num_output_tokens += m
            if r.output_chain is not None:
                r.output_chain.extend(r)
            r.last_token_time = end
            if r.num_output_tokens >= r.max_tokens:
                finished.append(r)
            elif r.on_progress is not None:
                r.on_progress(r.num_output_tokens)
        met.generation_tokens += m * n
        if finished:
            self._complete(finished, end)
        self._update_gauges()
        self._publish(end)
