"""Scheduler exactness on tiny configs: chunked prefill, preemption victim, FCFS."""

from engines.emulated.block_pool import BlockPool
from engines.emulated.kv_manager import KVCacheManager
from engines.emulated.request import EmuRequest
from engines.emulated.scheduler import Scheduler


def make(num_blocks=64, block_size=4, budget=8, max_seqs=16):
    pool = BlockPool(num_blocks, block_size, enable_events=False)
    kv = KVCacheManager(pool)
    return pool, kv, Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs)


def req(rid, prompt, max_tokens, hashes=()):
    return EmuRequest(rid, prompt, max_tokens, hashes, None, 0.0, None)


def apply(sched, kv, out):
    """What the engine does after a step: count tokens, sample, finish."""
    for r, n in zip(out.reqs, out.num_tokens):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.num_output_tokens += 1
            if r.num_output_tokens >= r.max_tokens:
                sched.running.remove(r)
                kv.free(r)


def test_chunked_prefill_tokens_per_step():
    _pool, kv, s = make(budget=8)
    r = req("a", 20, 3)
    s.add(r)
    steps = []
    while s.running or s.waiting:
        out = s.schedule()
        steps.append(out.num_tokens)
        apply(s, kv, out)
    assert steps == [[8], [8], [4], [1], [1]]


def test_budget_is_shared_running_first_then_fcfs():
    _pool, kv, s = make(budget=8)
    a, b = req("a", 6, 2), req("b", 6, 2)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [r.request_id for r in out.reqs] == ["a", "b"] and out.num_tokens == [6, 2]
    apply(s, kv, out)
    out = s.schedule()  # a decodes (running first), b continues its prefill
    assert [r.request_id for r in out.reqs] == ["a", "b"] and out.num_tokens == [1, 4]


def test_preemption_takes_the_last_running_request():
    # 4 usable blocks of 4 tokens; two 7-token prompts take 2 blocks each; the third block of the
    # first request's growth cannot be had: vLLM preempts the LAST running request
    pool, kv, s = make(num_blocks=5, block_size=4, budget=64)
    a, b = req("a", 7, 9), req("b", 7, 9)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert kv.block_ids(a) == [1, 2] and kv.block_ids(b) == [3, 4]
    apply(s, kv, out)
    apply(s, kv, s.schedule())  # decode: 8 and 9 tokens still fit 2 blocks... a/b now hold 9 tokens
    out = s.schedule()
    assert out.preempted == [b] and [r.request_id for r in out.reqs] == ["a"]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and s.waiting[0] is b
    assert kv.block_ids(a) == [1, 2, 4]  # b freed tail first: 4 then 3, a got the head (4)
    assert pool.free_queue.block_ids() == [3]


def test_prefix_hit_leaves_the_last_token_to_compute():
    _pool, kv, s = make(budget=64)
    a = req("a", 8, 1, hashes=(101, 102))
    s.add(a)
    apply(s, kv, s.schedule())
    b = req("b", 8, 1, hashes=(101, 102))
    s.add(b)
    out = s.schedule()
    # both blocks are cached but a full hit still recomputes the last token: 1 block hit, 4 computed
    assert b.cached_tokens == 4 and out.num_tokens == [4]
    assert kv.stats.queries == 16 and kv.stats.hits == 4


def _priority_sched(num_blocks=64, budget=8, max_seqs=16):
    pool = BlockPool(num_blocks, 4, enable_events=False)
    kv = KVCacheManager(pool)
    return kv, Scheduler(kv, max_num_batched_tokens=budget, max_num_seqs=max_seqs, policy="priority")


def test_priority_queue_order_is_priority_then_arrival_then_id():
    _kv, s = _priority_sched(max_seqs=1)
    reqs = [EmuRequest(rid, 4, 1, (), None, t, None, priority=p)
            for rid, t, p in (("c", 1.0, 1), ("b", 2.0, 0), ("a", 2.0, 0), ("d", 0.5, 2))]
    for r in reqs:
        s.add(r)
    assert [r.request_id for r in s.waiting] == ["a", "b", "c", "d"]


def test_priority_preempts_the_lowest_priority_and_returns_its_budget():
    # 5 usable blocks of 4 tokens. "lo" (priority 5) is scheduled first in the step; "hi" then
    # needs a block: vLLM preempts "lo" (lowest priority), takes its tokens out of the step's batch
    kv, s = _priority_sched(num_blocks=6, budget=16)
    hi = EmuRequest("hi", 8, 10, (), None, 0.0, None, priority=0)
    lo = EmuRequest("lo", 11, 10, (), None, 1.0, None, priority=5)
    for r in (hi, lo):
        s.add(r)
    out = s.schedule()
    assert [r.request_id for r in out.reqs] == ["hi", "lo"]
    apply(s, kv, out)
    s.running.reverse()  # put "lo" first in the running order: it is scheduled before "hi" needs a block
    for _ in range(4):
        out = s.schedule()
        apply(s, kv, out)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["lo"]
    assert [r.request_id for r in out.reqs] == ["hi"] and out.num_tokens == [1]
    assert [r.request_id for r in s.waiting] == ["lo"] and lo.num_computed_tokens == 0
