"""Regression: a PD decode instance hung (DeadlockError in simulation) with free capacity to spare.

The cause, on a tiny config: a consumer's KV transfer reserves blocks while another request is
running; that request then cannot grow, is its own preemption victim and goes back to the queue
head with nothing; the consumer's KV lands and it waits *behind* it, holding its blocks. Strict
FCFS then waits forever: the head needs the holder's blocks, the holder waits for the head, and
the step that preempted the only running request scheduled nothing and nobody woke the engine.
Each request alone fits the cache; both must finish, in virtual time.
"""

import asyncio

import pytest

from engines.base import GenerateRequest
from engines.emulated.block_pool import BlockPool
from engines.emulated.engine import EmulatedEngine
from engines.emulated.kv_manager import KVCacheManager
from engines.emulated.kv_transfer import TransferRegistry
from engines.emulated.request import RUNNING, WAITING, EmuRequest
from engines.emulated.scheduler import Scheduler
from gpuhit import vtime

from .conftest import tiny_profile

A_HASHES = tuple(range(100, 103))  # 12-token prompt: 3 full blocks of 4
B_HASHES = tuple(range(200, 206))  # 25-token prompt: 6 full blocks, the 25th token recomputed


async def _a_then_landed_b(prof, a_prompt, a_max_tokens, a_hashes):
    """P (default cache) runs B's producer step; D has 10 blocks (9 usable) of 4 tokens. A starts
    on D, B (KV on P) follows half a second later; both are awaited. Returns (t0, A, B, D)."""
    loop = asyncio.get_running_loop()
    reg = TransferRegistry(timeout_s=1000.0)
    p = EmulatedEngine("P", prof, transfer_registry=reg)
    # vLLM 0.32's full-sequence admission gate would keep B out until A is done, so this
    # situation needs it off (vLLM's scheduler_reserve_full_isl=False)
    d = EmulatedEngine("D", prof, num_gpu_blocks=10, transfer_registry=reg, reserve_full_isl=False)
    prod = await p.generate(GenerateRequest("B::producer", 25, 1, block_hashes=B_HASHES, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "tB"}))
    t0 = loop.time()
    a_task = loop.create_task(d.generate(GenerateRequest("A", a_prompt, a_max_tokens, block_hashes=a_hashes)))
    await asyncio.sleep(0.5)
    b = await d.generate(GenerateRequest("B", 25, 2, block_hashes=B_HASHES, kv_transfer_params=prod.kv_transfer_params))
    a = await a_task
    for e in (p, d):
        await e.close()
    return t0, a, b, d


def test_landed_transfer_behind_a_preempted_head_does_not_deadlock():
    # D: 10 blocks (9 usable) of 4 tokens, budget 8. 1 kB/token at 1 kB/s: B's 24-token pull takes 24 s.
    # A prefills 8 + 4 tokens (3 blocks); B arrives during A's first step, so at A's second step it
    # reserves the 6 remaining blocks for its pull; A's first decode needs a 4th block.
    t0, a, b, d = vtime.run(_a_then_landed_b(tiny_profile(nic_gbps=1e-6), 12, 3, A_HASHES))
    assert a.ok and b.ok, (a.error, b.error)
    assert (a.completion_tokens, b.completion_tokens) == (3, 2)
    assert a.num_preemptions == 1 and d.metrics.num_preemptions == 1
    assert b.external_cached_tokens == 24
    # B's pull starts with A's second step (t0 + 1.08) and lands 24 s later; then B goes first
    # (1 recomputed prompt token, 1 decode step) and A recomputes after it
    assert b.finish_time - t0 == pytest.approx(1.08 + 24 + 1.01 + 1.0)
    # A's prefix stays cached while it waits, less the block B's growth evicted: it recomputes 5
    # tokens (2-block hit) in one step, then decodes its last token
    assert a.finish_time - b.finish_time == pytest.approx(1.05 + 1.0)
    assert d.pool.num_free() == 9


def test_an_unschedulable_head_fails_instead_of_hanging(monkeypatch):
    # Defence in depth: with the scheduler's unblocking switched off, the same situation must
    # end A with an error result (and let B run), never leave the simulation waiting forever.
    monkeypatch.setattr(Scheduler, "_unblock", lambda self, head, out: False)
    _, a, b, d = vtime.run(_a_then_landed_b(tiny_profile(nic_gbps=1e-6), 12, 3, A_HASHES))
    assert b.ok and b.completion_tokens == 2
    assert a.error is not None and "could not schedule request 'A'" in a.error and d.metrics.request_errors == 1


def test_running_request_preempting_itself_for_a_landed_holder_steps_again():
    # B's pull (1.5 s) lands while A still decodes; A then needs a 4th block, which B's reservation
    # took: A is the only running request and its own victim. That step schedules nothing; the
    # engine must step again at once (nothing else would wake it) and let B, landed, go first.
    t0, a, b, _ = vtime.run(_a_then_landed_b(tiny_profile(nic_gbps=1.6e-5), 8, 8, A_HASHES[:2]))
    assert a.ok and b.ok, (a.error, b.error)
    assert (a.completion_tokens, b.completion_tokens, a.num_preemptions) == (8, 2, 1)
    assert b.external_cached_tokens == 24
    # A: prefill step (1.08) + 4 decode steps fill its 3 blocks; the 5th step preempts it at t0+5.08
    assert b.first_token_time - t0 == pytest.approx(5.08 + 1.01)
    assert b.finish_time - t0 == pytest.approx(5.08 + 1.01 + 1.0)


def _scheduler(num_blocks: int) -> tuple[KVCacheManager, Scheduler]:
    kv = KVCacheManager(BlockPool(num_blocks, 4, enable_events=False))
    return kv, Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=16)


def _landed(kv: KVCacheManager, rid: str, prompt: int, hashes: tuple[int, ...]) -> EmuRequest:
    """A request whose external KV (all full blocks) has landed: it holds them, WAITING."""
    r = EmuRequest(rid, prompt, 2, hashes, None, 0.0, None)
    n = len(hashes) * 4
    assert kv.allocate_slots(r, n) is not None
    r.num_computed_tokens = n
    r.admitted = True
    return r


def test_unblock_lets_a_landed_holder_pass_a_head_holding_nothing():
    kv, s = _scheduler(num_blocks=7)  # 6 usable
    head = EmuRequest("head", 16, 2, tuple(range(4)), None, 0.0, None)  # its first chunk needs 2 blocks
    holder = _landed(kv, "holder", 21, tuple(range(50, 55)))  # holds 5, needs the 6th and last
    s.add(head)
    s.waiting.append(holder)
    holder.status = WAITING
    out = s.schedule()
    assert [r.request_id for r in out.reqs] == ["holder"] and out.num_tokens == [1]
    assert [r.request_id for r in s.waiting] == ["head"] and holder.status == RUNNING
    assert not out.preempted


def test_unblock_frees_the_last_other_holder_for_a_holder_at_the_head():
    kv, s = _scheduler(num_blocks=9)  # 8 usable: two holders of 4 full blocks, no block left
    first = _landed(kv, "first", 17, tuple(range(4)))
    second = _landed(kv, "second", 17, tuple(range(50, 54)))
    for r in (first, second):
        s.waiting.append(r)
        r.status = WAITING
    out = s.schedule()
    # "second" is freed (its blocks stay cached) and recomputes later; "first" gets its 5th block
    assert [r.request_id for r in out.preempted] == ["second"]
    assert [r.request_id for r in out.reqs] == ["first"] and out.num_tokens == [1]
    assert second.num_computed_tokens == 0 and second.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["second"]
    assert kv.block_ids(second) == []
