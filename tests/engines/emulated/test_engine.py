"""EmulatedEngine end to end in virtual time: timings, preemption, decode jumps, tiers, PD, metrics."""

import asyncio

import pytest

from engines.base import EngineClient, GenerateRequest
from engines.emulated.engine import EmulatedEngine
from engines.emulated.kv_transfer import TransferRegistry
from engines.kv_events import BlockStored
from gpuhit import vtime

from .conftest import tiny_profile


def run(coro):
    return vtime.run(coro)


def test_is_an_engine_client_and_chunked_prefill_timing(tiny):
    async def main():
        e = EmulatedEngine("e", tiny, jump_decode=False)
        assert isinstance(e, EngineClient)
        res = await e.generate(GenerateRequest("a", 20, 3))
        steps = e.metrics.num_steps
        await e.close()
        return res, steps

    res, steps = run(main())
    # chunks 8, 8, 4 (1 s + 10 ms/token each), then 2 decode steps of 1 s
    assert steps == 5
    assert res.first_token_time == pytest.approx(3.2)
    assert res.finish_time == pytest.approx(5.2)
    assert res.completion_tokens == 3 and res.cached_tokens == 0


def test_max_model_len_rejection_uses_vllms_text(tiny):
    async def main():
        e = EmulatedEngine("e", tiny, max_model_len=100)
        r = await e.generate(GenerateRequest("a", 90, 20))
        await e.close()
        return r

    r = run(main())
    assert r.error == ("This model's maximum context length is 100 tokens. However, you requested 110 tokens "
                       "(90 in the messages, 20 in the completion). Please reduce the length of the messages "
                       "or completion.")


def test_request_larger_than_the_pool_is_rejected(tiny):
    async def main():
        e = EmulatedEngine("e", tiny, num_gpu_blocks=5)
        r = await e.generate(GenerateRequest("a", 16, 4))
        await e.close()
        return r

    r = run(main())
    assert "needs 5 KV cache blocks" in r.error and "holds only 4" in r.error


def test_preempted_request_is_the_last_one_and_completes_later():
    prof = tiny_profile(max_num_batched_tokens=64)

    async def main():
        e = EmulatedEngine("e", prof, num_gpu_blocks=5)
        a, b = await asyncio.gather(e.generate(GenerateRequest("a", 7, 9)), e.generate(GenerateRequest("b", 7, 9)))
        n = e.metrics.num_preemptions
        await e.close()
        return a, b, n

    a, b, n = run(main())
    assert n == 1 and a.num_preemptions == 0 and b.num_preemptions == 1
    assert a.ok and b.ok and b.completion_tokens == 9
    assert b.first_token_time < a.finish_time < b.finish_time


def _workload(jump: bool, events: list | None = None):
    """Staggered arrivals, a small pool (preemption + evictions), decode costs growing with context."""
    prof = tiny_profile(max_num_batched_tokens=16, decode_per_ctx_token_s=0.001, per_seq_overhead_s=0.01,
                        frontend_overhead_s=0.05)
    specs = [("a", 0.0, 30, 40), ("b", 0.3, 12, 25), ("c", 7.77, 50, 10), ("d", 8.2, 9, 60), ("e", 30.1, 30, 5)]

    async def main():
        e = EmulatedEngine("e", prof, num_gpu_blocks=40, jump_decode=jump)
        if events is not None:
            e.subscribe_kv_events(events.append)

        async def one(rid, t, p, m):
            await asyncio.sleep(t)
            hashes = tuple(hash((rid[0] < "c", i)) & 0xFFFF for i in range(p // 4))
            return await e.generate(GenerateRequest(rid, p, m, block_hashes=hashes))

        res = await asyncio.gather(*(one(*s) for s in specs))
        stats = (e.num_jumps, e.num_interrupted_jumps, e.metrics.num_preemptions, e.metrics.num_steps)
        await e.close()
        return {r.request_id: (r.first_token_time, r.finish_time, r.num_preemptions) for r in res}, stats

    return run(main())


def test_decode_jump_gives_identical_times_events_and_steps():
    ev_jump, ev_step = [], []
    jumped, (jumps, interrupted, pre_j, steps_j) = _workload(True, ev_jump)
    stepped, (no_jumps, _, pre_s, steps_s) = _workload(False, ev_step)
    assert jumps > 0 and interrupted > 0 and no_jumps == 0
    assert jumped == stepped  # bit-identical first-token and finish times
    assert pre_j == pre_s and steps_j == steps_s
    assert [ev for b in ev_jump for ev in b.events] == [ev for b in ev_step for ev in b.events]


def test_arrival_interrupts_a_jump_at_the_step_in_flight(tiny):
    async def main():
        e = EmulatedEngine("e", tiny)
        long = asyncio.ensure_future(e.generate(GenerateRequest("long", 4, 100)))
        await asyncio.sleep(10.5)  # mid-way through decode step 10 (steps end at 1.04, 2.04, ...)
        short = await e.generate(GenerateRequest("short", 4, 1))
        res = await long
        assert e.num_interrupted_jumps >= 1
        await e.close()
        return short, res

    short, long = run(main())
    # the arrival waits for the step in flight (ends at 11.04), then prefills beside the decode
    assert short.first_token_time == pytest.approx(12.08)
    assert long.finish_time == pytest.approx(1.04 + 99 * 1.0 + 0.04)


def test_abort_fails_the_request_and_frees_blocks(tiny):
    async def main():
        e = EmulatedEngine("e", tiny)
        t = asyncio.ensure_future(e.generate(GenerateRequest("a", 8, 1000)))
        await asyncio.sleep(5.5)
        assert e.abort("a")
        r = await t
        free = e.pool.num_free()
        await e.close()
        return r, free, e.pool.num_usable

    r, free, usable = run(main())
    assert r.error == "aborted" and free == usable


def test_cpu_tier_hit_costs_the_pcie_load():
    prof = tiny_profile(pcie_gbps=1e-6, cpu_load_overhead_s=0.5, kv_bytes_per_token=1000,
                        max_num_batched_tokens=64)
    events = []

    async def main():
        e = EmulatedEngine("e", prof, num_gpu_blocks=6, cpu_offload_bytes=100 * 4000)
        e.subscribe_kv_events(events.append)
        await e.generate(GenerateRequest("a", 16, 1, block_hashes=(1, 2, 3, 4)))
        await e.generate(GenerateRequest("filler", 19, 1, block_hashes=(9, 8, 7, 6)))
        assert e.cached_block_hashes("CPU") >= {1, 2, 3, 4}
        t0 = asyncio.get_running_loop().time()
        r = await e.generate(GenerateRequest("a2", 16, 1, block_hashes=(1, 2, 3, 4)))
        await e.close()
        return r, t0

    r, t0 = run(main())
    # 3 blocks (the last token is recomputed) x 4 tokens x 1000 B at 1 kB/s = 12 s + 0.5 s, then one step
    assert r.external_cached_tokens == 12 and r.cached_tokens == 0
    assert r.first_token_time - t0 == pytest.approx(12.5 + 1.04)
    cpu_events = [ev for b in events for ev in b.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    assert [ev.block_hashes for ev in cpu_events][:4] == [(4,), (3,), (2,), (1,)]  # tail evicted first
    assert cpu_events[1].parent_block_hash == 2


def test_pd_transfer_producer_consumer_and_fallback():
    prof = tiny_profile(max_num_batched_tokens=64, nic_gbps=1e-6, transfer_overhead_s=0.25)

    async def main():
        reg = TransferRegistry(timeout_s=120.0)
        p = EmulatedEngine("P", prof, transfer_registry=reg, bootstrap_addr="http://p:8998")
        d = EmulatedEngine("D", prof, transfer_registry=reg)
        hashes = tuple(range(100, 110))
        pr = await p.generate(GenerateRequest("r", 40, 1, block_hashes=hashes, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t1"}))
        pinned = p.pool.num_usable - p.pool.num_free()
        t0 = asyncio.get_running_loop().time()
        params = dict(pr.kv_transfer_params)
        cr = await d.generate(GenerateRequest("r", 40, 5, block_hashes=hashes, kv_transfer_params=params))
        after = p.pool.num_usable - p.pool.num_free()
        fb = await d.generate(GenerateRequest("x", 40, 2, block_hashes=tuple(range(500, 510)),
                                              kv_transfer_params={**params, "transfer_id": "nope"}))
        stats = (d.metrics.kv_transfer_bytes, d.metrics.kv_transfer_failures, len(reg))
        text = d.render_prometheus()
        for x in (p, d):
            await x.close()
        return pr, pinned, cr, t0, after, fb, stats, text

    pr, pinned, cr, t0, after, fb, (nbytes, failures, left), text = run(main())
    assert pr.kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P",
        "remote_bootstrap_addr": "http://p:8998", "remote_block_ids": list(range(1, 11)), "transfer_id": "t1",
        "num_tokens": 40}
    assert pinned == 10 and after == 0 and left == 0
    # 9 blocks (last token recomputed) x 4 tokens x 1000 B at 1 kB/s + 0.25 s, then a 4-token step
    assert cr.external_cached_tokens == 36 and cr.cached_tokens == 0
    assert cr.first_token_time - t0 == pytest.approx(36.25 + 1.04)
    assert nbytes == 36000
    assert fb.ok and fb.external_cached_tokens == 0 and failures == 1
    assert 'vllm:prompt_tokens_by_source_total{engine="D",model_name="tiny",source="external_kv_transfer"} 36.0' in text


def test_unclaimed_transfer_expires_and_unpins():
    prof = tiny_profile(max_num_batched_tokens=64)

    async def main():
        reg = TransferRegistry(timeout_s=120.0)
        p = EmulatedEngine("P", prof, transfer_registry=reg)
        await p.generate(GenerateRequest("r", 40, 1, block_hashes=tuple(range(10)), kv_transfer_params={
            "do_remote_decode": True, "transfer_id": "t"}))
        before = p.pool.num_free()
        await asyncio.sleep(121)  # virtual time
        after = p.pool.num_free()
        await p.close()
        return before, after, p.pool.num_usable, reg.expired

    before, after, usable, expired = run(main())
    assert before == usable - 10 and after == usable and expired == 1


def test_metrics_exposition_and_utilization(tiny):
    async def main():
        e = EmulatedEngine("e", tiny)
        await e.generate(GenerateRequest("a", 8, 3, block_hashes=(1, 2)))
        await asyncio.sleep(2.08)
        await e.generate(GenerateRequest("b", 8, 3, block_hashes=(1, 2)))
        text = e.render_prometheus()
        util = e.utilization()
        series = e.metrics.utilization_series()
        await e.close()
        return text, util, series

    text, util, series = run(main())
    for name in ("vllm:num_requests_running{", "vllm:kv_cache_usage_perc{", "vllm:prefix_cache_queries_total{",
                 "vllm:prefix_cache_hits_total{", "vllm:generation_tokens_total{", "vllm:num_preemptions_total{",
                 'vllm:time_to_first_token_seconds_bucket{engine="e",le="0.001",model_name="tiny"}',
                 "vllm:inter_token_latency_seconds_count{", "vllm:e2e_request_latency_seconds_sum{",
                 "vllm:request_queue_time_seconds_bucket{", "vllm:request_prefill_time_seconds_count{",
                 "vllm:request_decode_time_seconds_count{"):
        assert name in text
    assert 'vllm:prefix_cache_hits_total{engine="e",model_name="tiny"} 4.0' in text
    assert 'vllm:generation_tokens_total{engine="e",model_name="tiny"} 6.0' in text
    # busy 3.08 s (a) + 3.04 s (b: 4-token prefill after a 1-block hit) over 3.08 + 2.08 + 3.04 s
    assert util == pytest.approx(6.12 / 8.2)
    assert series[0] == (0.0, 1.0)
