"""KV cache manager: vLLM v1's ``KVCacheManager`` for one full-attention KV group.

Allocation policy over the block pool: longest prefix hit, slot allocation for the tokens a step
computes, caching of blocks as they fill, and freeing in reverse order. Requests carry their
prompt's 64-bit block hashes; blocks past the prompt's full blocks (generated tokens, the partial
tail) are allocated but not cached, because the tokens a real engine would generate are unknown to
the emulator (a later turn's prompt brings its own hashes for them), unless the request carries
them (``EmuRequest.output_chain``): then its hashes grow as it decodes and those blocks are cached
as vLLM caches them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from engines.emulated.block_ids import BLOCK_ID, NO_BLOCKS, BlockList, as_block_ids, positions
from engines.emulated.block_pool import BlockPool
from engines.emulated.request import EmuRequest
from engines.hashing import present_run_end
from engines.keyed_hashes import keys_of


class PrefixCacheStats:
    """vLLM's ``PrefixCacheStats``: lookups of preempted requests are kept apart."""

    __slots__ = ("hits", "preempted_hits", "preempted_queries", "preempted_requests", "queries", "requests")

    def __init__(self) -> None:
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


#: block ids of finished runs kept for lookups, in multiples of the pool's size
_RUNS_KEPT = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """``get_computed_blocks`` / ``allocate_slots`` / ``free`` over a :class:`BlockPool`.

    ``emit_token_ids`` puts the blocks' token ids in BlockStored events (live path); off in
    simulation, where prompts are hash ids only. ``on_cached(hashes)`` sees every newly cached
    run of hashes (a remote store writes them through).
    """

    def __init__(
        self,
        pool: BlockPool,
        *,
        emit_token_ids: bool = True,
        on_cached: Callable[[Sequence[int]], None] | None = None,
        enable_caching: bool = True,
    ):
        self.pool = pool
        # vLLM's --no-enable-prefix-caching: no lookups, nothing cached (so no events, no hits)
        self.enable_caching = enable_caching
        self.block_size = pool.block_size
        self.emit_token_ids = emit_token_ids
        self.on_cached = on_cached
        self.req_blocks: dict[str, BlockList] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # Blocked-lookup memo (speed only; see get_computed_blocks): the request whose prefix hit
        # could not be allocated, its max_blocks, hit blocks and evictable count. Armed only while
        # the pool watches those blocks; pool.watch_dirty means "look up again".
        self._memo_req: EmuRequest | None = None
        self._memo_max = -1
        self._memo_blocks: np.ndarray = NO_BLOCKS
        self._memo_evictable = 0
        self._last_req: EmuRequest | None = None  # the latest lookup (to arm the memo on failure)
        self._last_blocks: np.ndarray = NO_BLOCKS
        self._last_max = -1
        self.memo_hits = 0  # lookups answered by the memo (speed diagnostics, tests)
        # Runs of finished requests (speed only; see longest_hit): run id -> its cached blocks in
        # chain order, and per block the latest run holding it and its position there.
        n = pool.num_blocks
        self._runs: dict[int, np.ndarray] = {}
        self._run_of = np.full(n, -1, np.int64)
        self._pos_in_run = np.full(n, -1, np.int64)
        self._next_run = 0
        self._runs_size = 0
        self.run_hits = 0  # lookups answered from a run (speed diagnostics, tests)

    # ---- lookups -------------------------------------------------------------------------------
    def longest_hit(self, hashes: Sequence[int], max_blocks: int) -> np.ndarray:
        """Cached blocks of the longest prefix of ``hashes`` (at most ``max_blocks``).

        Why not a plain scan: a waiting request that cannot get blocks repeats this lookup every
        step, over ~6,500 blocks for an agentic prompt. Chain positions are binary-searched
        instead (vLLM frees a request's blocks tail first, so a chain's cached blocks are almost
        always a prefix), then the block ids are fetched in one C-level pass. Exactness does not
        rest on prefix-closedness: the search ends at a position ``k`` whose block is cached and
        whose successor is not, so the first miss is at most ``k``; a miss inside ``[0, k)`` (a
        hole, or hashes that are not chained) shows up as a ``None`` and cuts the answer there,
        which is what the scan would return. Before fetching, the blocks are looked for in the
        finished run that holds the last one (:meth:`_from_run`), which answers nearly every
        agentic turn several times faster.
        """
        n = min(len(hashes), max_blocks)
        if n <= 0:
            return NO_BLOCKS
        cached = self.pool._cached
        if hashes[0] not in cached:
            return NO_BLOCKS
        k = present_run_end(hashes, cached, 1, n)
        hs = hashes[:k] if k < len(hashes) else hashes
        if not self.pool._dups:
            keys = keys_of(hashes)
            blocks = self._from_run(hs, cached[hs[-1]], None if keys is None else keys[:k])
            if blocks is not None:
                return blocks
        blocks = cached.get_all(hs)
        if blocks is None:  # a hole below k
            out = list(map(cached.get, hs))
            return np.array(out[: out.index(None)], BLOCK_ID)
        return blocks

    def _from_run(self, hs: Sequence[int], last: int, keys: np.ndarray | None = None) -> np.ndarray | None:
        """The blocks of ``hs`` read off a finished run, or None (caller: no duplicates anywhere;
        ``last`` is the block cached under ``hs[-1]``; ``keys``: ``hs`` as int64, when known).

        Why: the blocks an agentic turn hits are, nearly always, the blocks a finished request
        (the session's previous turn) held at the same chain positions. The run holding the
        block of the last hash gives candidates; they are the answer if each still holds its
        hash (without duplicates, a block holding ``h`` is the one ``h`` maps to). Checking that
        is one vectorized gather and a list comparison, several times cheaper than a lookup per
        block. Any mismatch: None, and the caller looks up.
        """
        k = len(hs)
        if self._pos_in_run[last] != k - 1:
            return None
        run = self._runs.get(int(self._run_of[last]))
        if run is None:
            return None
        cand = run[:k]
        pool = self.pool
        if not pool.has_hash[cand].all():
            return None
        if pool.int_keys:  # chain ids: int64 arrays, compared in one pass
            if keys is None:
                keys = np.fromiter(hs, np.int64, k)
            if not (pool.block_hash[cand] == keys).all():
                return None
        elif pool.block_hash[cand].tolist() != (hs if isinstance(hs, list) else list(hs)):
            return None  # vLLM's hashes: the very int objects, compared at memory speed
        self.run_hits += 1
        return cand

    def _remember_run(self, ids: np.ndarray) -> None:
        """Record a finished request's cached blocks (chain order) for :meth:`_from_run`."""
        r = self._next_run
        self._next_run = r + 1
        self._run_of[ids] = r
        self._pos_in_run[ids] = positions(len(ids))
        runs = self._runs
        runs[r] = ids
        self._runs_size += len(ids)
        # the oldest runs' blocks are mostly reused by now: keep a few times the pool's blocks
        while self._runs_size > _RUNS_KEPT * self.pool.num_blocks:
            self._runs_size -= len(runs.pop(next(iter(runs))))

    def longest_hit_scan(self, hashes: Sequence[int], max_blocks: int) -> np.ndarray:
        """Reference linear scan (the definition :meth:`longest_hit` must match; tests)."""
        get = self.pool._cached.get
        out: list[int] = []
        for h in hashes[:max_blocks] if max_blocks < len(hashes) else hashes:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return as_block_ids(out)

    def get_computed_blocks(self, req: EmuRequest) -> tuple[np.ndarray, int]:
        """Local prefix hit of a request about to be scheduled: (blocks, tokens).

        At most ``num_tokens - 1`` tokens: even a full hit recomputes the last token to get logits.
        Not counted in the prefix-cache stats here: like vLLM 0.32, the scheduler counts a lookup
        only when the request is admitted (:meth:`record_admission`), so a request blocked at the
        head of the queue is counted once, not once per step.

        Why a memo: a waiting request that cannot get blocks stays at the queue head and vLLM
        looks its prefix up again on every step (each lookup counts in the stats, as in vLLM);
        for agentic prompts that is thousands of blocks per step. The answer is reused while
        nothing could have changed it: the same request and ``max_blocks``, no watched block
        evicted or crossing ref count zero (the pool's ``watch_dirty``), and the hash after the
        hit still not cached. Under those conditions the scan would return the same blocks.
        """
        if not self.enable_caching:
            return NO_BLOCKS, 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        if (
            self._memo_req is req
            and self._memo_max == max_blocks
            and not self.pool.watch_dirty
            and self._memo_boundary_holds(req.block_hashes, max_blocks)
        ):
            blocks = self._memo_blocks
            self.memo_hits += 1
        else:
            if self._memo_req is not None:
                self._disarm()
            blocks = self.longest_hit(req.block_hashes, max_blocks)
        self._last_req, self._last_blocks, self._last_max = req, blocks, max_blocks
        return blocks, len(blocks) * self.block_size

    def record_admission(self, req: EmuRequest, num_hits: int) -> None:
        """Count an admitted request's lookup in the prefix-cache stats (vLLM's
        ``record_prefix_cache_stats``, called once the request's blocks are allocated)."""
        if self.enable_caching:
            self.stats.record(req.num_tokens, num_hits, req.num_preemptions > 0)

    def _memo_boundary_holds(self, hashes: Sequence[int], max_blocks: int) -> bool:
        """The block after the memoized hit is still not cached (else the hit would be longer)."""
        k = len(self._memo_blocks)
        return k >= max_blocks or k >= len(hashes) or hashes[k] not in self.pool._cached

    def _arm(self, req: EmuRequest, blocks: np.ndarray, evictable: int) -> None:
        self._memo_req, self._memo_max = req, self._last_max
        self._memo_blocks, self._memo_evictable = blocks, evictable
        self.pool.set_watch(blocks)  # an empty hit: nothing watched, only the boundary to check

    def _disarm(self) -> None:
        self._memo_req = None
        self._memo_blocks = NO_BLOCKS
        self.pool.set_watch(NO_BLOCKS)

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(
        self,
        req: EmuRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: np.ndarray = NO_BLOCKS,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
    ) -> np.ndarray | None:
        """Blocks for ``num_new_tokens`` more tokens after the computed ones, or None if short.

        Like vLLM, a hit block sitting in the free queue counts against the free blocks (touching
        it takes it out), and full blocks are cached at allocation time, before the step runs.
        ``full_sequence_must_fit`` is vLLM's admission gate (``scheduler_reserve_full_isl``, on by
        default): a waiting request is admitted only if blocks for *all* its tokens fit, not just
        for this step's chunk.
        """
        rid = req.request_id
        held = self.req_blocks.get(rid)
        n_held = len(held) if held is not None else 0
        num_computed = req.num_computed_tokens + num_new_computed_tokens
        need_tokens = num_computed + num_new_tokens
        n_hit = len(new_computed_blocks)
        n_new = cdiv(need_tokens, self.block_size) - n_hit - n_held
        n_new = max(n_new, 0)
        # hit blocks with ref count 0 sit in the free queue: taking them reduces the free count
        memo = self._memo_req is req and new_computed_blocks is self._memo_blocks and not self.pool.watch_dirty
        if memo:
            evictable = self._memo_evictable
        elif n_hit:
            new_computed_blocks = as_block_ids(new_computed_blocks)
            evictable = n_hit - int(np.count_nonzero(self.pool.ref_cnt[new_computed_blocks]))
        else:
            evictable = 0
        free = self.pool.free_queue.num_free
        if full_sequence_must_fit and n_new < (
                full := max(cdiv(req.num_tokens, self.block_size) - n_hit - n_held, 0)):
            n_check = full
        else:
            n_check = n_new
        if n_check + evictable > free:
            if not memo and req is self._last_req and new_computed_blocks is self._last_blocks:
                # blocked at the head of the queue: it will look the same prefix up next step
                self._arm(req, self._last_blocks, evictable)
            return None
        if self._memo_req is req:
            self._disarm()
        if held is None:
            held = self.req_blocks[rid] = BlockList()
            self.num_cached_blocks[rid] = 0
        if n_hit:
            # a hit listing a block twice, or one the request holds already, makes its list repeat
            # a block: the pool's free then counts each occurrence (see BlockList.distinct)
            held.distinct = self.pool.touch(new_computed_blocks) and held.distinct and not len(held)
            held.extend(new_computed_blocks)
            # hit blocks are cached already
            self.num_cached_blocks[rid] = len(held)
        new_blocks = self.pool.get_new_blocks(n_new) if n_new else NO_BLOCKS
        if n_new:
            held.extend(new_blocks)
        if not delay_cache_blocks and self.enable_caching:
            self.cache_blocks(req, min(need_tokens, req.num_tokens))
        return new_blocks

    def append_blocks(self, reqs: Sequence[EmuRequest], owners: np.ndarray) -> None:
        """One more block for ``reqs[owners[i]]`` per allocation ``i``, in this order (a decode stretch's
        allocations: one pop of the free queue, the evictions and their events as one allocation
        per block would make them; the caller checked there is space)."""
        n = len(owners)
        if not n:
            return
        ids = self.pool.get_new_blocks(n, event_per_block=True)
        rb = self.req_blocks
        if n == 1:
            rb[reqs[int(owners[0])].request_id].extend(ids)
            return
        # each request's blocks in allocation order: a stable sort by owner
        ids = ids[np.argsort(owners, kind="stable")]
        pos = 0
        for r, c in zip(reqs, np.bincount(owners, minlength=len(reqs)).tolist()):
            if c:
                rb[r.request_id].extend(ids[pos : pos + c])
                pos += c

    def cache_blocks(self, req: EmuRequest, num_tokens: int) -> None:
        """Cache the request's full blocks covering its first ``num_tokens`` tokens."""
        rid = req.request_id
        start = self.num_cached_blocks[rid]
        end = min(num_tokens // self.block_size, len(req.block_hashes))
        if end <= start:
            return
        bs = self.block_size
        tokens: tuple[int, ...] = ()
        if self.emit_token_ids and req.token_ids is not None:
            tokens = tuple(req.token_ids[start * bs : end * bs])
        self.pool.cache_full_blocks(self.req_blocks[rid].view(), req.block_hashes, start, end, tokens)
        self.num_cached_blocks[rid] = end
        if self.on_cached is not None:
            self.on_cached(req.block_hashes[start:end])

    def free(self, req: EmuRequest) -> None:
        """Release the request's blocks, tail first (so the tail is evicted before the prefix)."""
        if self._memo_req is req:
            self._disarm()
        blocks = self.req_blocks.pop(req.request_id, None)
        m = self.num_cached_blocks.pop(req.request_id, 0)
        if m:
            self._remember_run(blocks.view()[:m].copy())
        if blocks:
            self.pool.free_blocks(blocks.view()[::-1], known_distinct=blocks.distinct)

    def block_ids(self, req: EmuRequest) -> list[int]:
        blocks = self.req_blocks.get(req.request_id)
        return blocks.view().tolist() if blocks is not None else []
