"""End to end on loopback: replayer (live HttpTarget) -> gateway -> 2 emulated vLLM servers, real HTTP + ZMQ."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp

from engines.emulated.engine import EmulatedEngine
from engines.emulated.profile import load_profile
from replayer.arrivals import ArrivalConfig
from replayer.driver import DriverConfig, replay
from replayer.live import HttpTarget, UtilizationSampler, make_meter
from replayer.synth import TokenSynthesizer
from replayer.trace import Session, Trace, Turn
from tests.e2e.helpers import gateway, servers, wait_until


def fast_profile():
    p = load_profile("qwen3-coder-30b-a3b@h20")
    # Small but non-zero costs: real time passes, the test stays fast.
    return dataclasses.replace(p, step_overhead_s=1e-4, prefill_per_token_s=1e-7, prefill_attn_s=0.0,
                               decode_per_ctx_token_s=0.0, per_seq_overhead_s=0.0, frontend_overhead_s=0.0,
                               frontend_per_token_s=0.0)


def small_trace() -> Trace:
    sessions = []
    for s in range(4):
        turns = []
        ids: list[int] = []
        for k in range(3):
            ids = ids + [100 * s + k * 10 + j for j in range(4)]  # each turn extends the previous one
            turns.append(Turn(input_length=len(ids) * 16 - 3, output_length=4, hash_ids=tuple(ids)))
        sessions.append(Session(f"s{s}", tuple(turns), block_size=16, namespace=f"s{s}"))
    return Trace("tiny", "native", tuple(sessions))


def test_replay_through_gateway_precise_index_matches_engines():
    async def main():
        engines = [EmulatedEngine(f"emu{i}", fast_profile(), num_gpu_blocks=64, model_name="m") for i in range(2)]
        async with servers(engines, model="m") as srvs:
            urls = [f"http://127.0.0.1:{s.port}" for s in srvs]
            async with gateway(urls, policy="lpwl") as (gw, url), aiohttp.ClientSession() as http:
                inner = HttpTarget(url, TokenSynthesizer(seed=1), http)

                class SyncedTarget:
                    """Routes each turn only once the gateway's index has caught up with the
                    engines' KV events: the events travel asynchronously over ZMQ, so without this
                    a loaded machine could route turn k+1 before turn k's blocks are indexed."""

                    async def submit(self, req):
                        for i, eng in enumerate(engines):
                            await wait_until(lambda i=i, eng=eng: gw.router.index.cached(i) == eng.cached_block_hashes(),
                                             what=f"index of e{i} to catch up")
                        return await inner.submit(req)

                target = SyncedTarget()
                sampler = UtilizationSampler([(f"e{i}", make_meter(f"busy:{u}", http)) for i, u in enumerate(urls)])
                await sampler.sample_once()
                out = await replay(small_trace(), target, DriverConfig(arrival=ArrivalConfig(time_scale=0.0)))
                await sampler.sample_once()
                recs = out.records
                assert len(recs) == 12 and all(r.ok for r in recs), [r.error for r in recs if r.error]
                assert all(r.output_tokens == 4 for r in recs)
                assert all(r.first_token <= r.finish for r in recs)
                for r in recs:
                    assert r.action == "forward" and r.instance in ("e0", "e1")
                    # The precise index predicted exactly what the engine then served from its cache.
                    assert r.realized_hit_tokens == r.predicted_hit_tokens
                assert all(r.realized_hit_tokens == 0 for r in recs if r.turn == 0)
                assert sum(r.realized_hit_tokens for r in recs) > 0
                # The precise index, built from ZMQ KV events only, equals each engine's cached blocks.
                for i, eng in enumerate(engines):
                    await wait_until(lambda i=i, eng=eng: gw.router.index.cached(i) == eng.cached_block_hashes(),
                                     what=f"index of e{i} to match engine")
                assert sum(len(e.cached_block_hashes()) for e in engines) > 0
                assert {name for _, name, _ in sampler.rows} == {"e0", "e1"}
                assert all(0.0 <= u <= 1.0 for _, _, u in sampler.rows)
        for e in engines:
            await e.close()

    asyncio.run(main())
