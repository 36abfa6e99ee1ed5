"""Cross-process PD transfer between emulated engines: real aiohttp servers on 127.0.0.1, real HTTP.

Each engine sits behind its own AppRunner (as in ``gpuhit emulate``, one process per engine); the
transfer's metadata, the engine-id check and the producer's release all go over HTTP. Engines run
in real time with a near-zero-cost profile, so the tests are fast; what is asserted is bookkeeping
(block ids, token counts, bytes and the charged loop seconds), never elapsed time.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from engines.base import GenerateRequest
from engines.emulated.engine import EmulatedEngine
from engines.emulated.kv_transfer import TransferRegistry
from engines.emulated.remote_transfer import (
    BootstrapServer,
    RemoteTransferClient,
    bootstrap_url,
    mount_remote_transfer,
)
from gpuhit.vtime import run

from .conftest import tiny_profile

HASHES = tuple(range(100, 110))  # 10 full blocks of 4 tokens
PROMPT = 42  # 10 full blocks + 2 tokens: every full block is transferable ((42 - 1) // 4 == 10)


def engine(name: str, prof, **kw) -> EmulatedEngine:
    return EmulatedEngine(name, prof, num_gpu_blocks=64, **kw)  # small pool: fast to build


def fast_profile(**kw):
    # No step, frontend or NIC overhead worth waiting for in real time; 1 GB/s NIC so the charged
    # transfer time is a known non-zero number.
    base = {"step_overhead_s": 0.0, "prefill_per_token_s": 0.0, "max_num_batched_tokens": 64,
                "nic_gbps": 1.0, "transfer_overhead_s": 0.001}
    base.update(kw)
    return tiny_profile(**base)


class Node:
    """One engine behind its own aiohttp server (its own AppRunner and port)."""

    def __init__(self, engine: EmulatedEngine, lease_s: float | None = None, middlewares=()):
        self.engine = engine
        self.app = web.Application(middlewares=list(middlewares))
        self.service = mount_remote_transfer(self.app, engine, lease_s=lease_s)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Node:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        port = self.runner.addresses[0][1]
        self.url = bootstrap_url("127.0.0.1", port)
        self.engine.bootstrap_addr = self.url
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def close(self) -> None:
        await self.stop()
        await self.engine.close()


async def produce(p: EmulatedEngine, tid: str = "t1", hashes=HASHES, rid: str = "p1"):
    return await p.generate(GenerateRequest(rid, PROMPT, 1, block_hashes=hashes, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}))


def pinned(e: EmulatedEngine) -> int:
    return e.pool.num_usable - e.pool.num_free()


def test_pd_transfer_over_http_then_local_hit():
    prof = fast_profile()

    async def main():
        pn = await Node(engine("P", prof)).start()
        dn = await Node(engine("D", prof)).start()
        p, d = pn.engine, dn.engine
        try:
            pr = await produce(p)
            pinned_before = pinned(p)
            cr = await d.generate(GenerateRequest("c1", PROMPT, 3, block_hashes=HASHES,
                                                  kv_transfer_params=dict(pr.kv_transfer_params)))
            await d.remote_transfer.drain()  # the producer has answered the release
            third = await d.generate(GenerateRequest("c2", PROMPT, 1, block_hashes=HASHES))
            return {
                "pr": pr, "url": pn.url, "pinned_before": pinned_before, "cr": cr, "third": third,
                "p_pinned_after": pinned(p), "p_pending": len(p.registry), "p_leased": p.registry.num_leased(),
                "p_claimed": p.registry.claimed, "svc": (pn.service.pulls, pn.service.releases),
                "d_cached": d.cached_block_hashes(), "d_left": len(d.registry),
                "d_metrics": (d.metrics.kv_transfers, d.metrics.kv_transfer_bytes, d.metrics.kv_transfer_seconds,
                           d.metrics.kv_transfer_failures),
                "client": (d.remote_transfer.pulls, d.remote_transfer.pull_failures, d.remote_transfer.releases,
                        d.remote_transfer.release_failures),
            }
        finally:
            await dn.close()
            await pn.close()

    r = asyncio.run(main())
    assert r["pr"].kv_transfer_params == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "P",
        "remote_bootstrap_addr": r["url"], "remote_block_ids": list(range(1, 12)), "transfer_id": "t1",
        "num_tokens": PROMPT}
    assert r["pinned_before"] == 11  # 10 full blocks + the partial one, held for the consumer
    cr = r["cr"]
    assert cr.ok and cr.completion_tokens == 3
    assert cr.external_cached_tokens == 40 and cr.cached_tokens == 0  # every pinned full block
    assert r["d_metrics"] == (1, 40_000, pytest.approx(prof.transfer_time(40_000)), 0)
    assert r["client"] == (1, 0, 1, 0)
    # the producer's pin is gone: nothing pending, nothing leased, every block free again
    assert r["p_pinned_after"] == 0 and r["p_pending"] == 0 and r["p_leased"] == 0
    assert r["p_claimed"] == 1 and r["svc"] == (1, 1)
    # the consumer now holds the blocks itself: a third request is a local hit
    assert set(HASHES) <= r["d_cached"] and r["d_left"] == 0
    third = r["third"]
    assert third.ok and third.cached_tokens == 40 and third.external_cached_tokens == 0


def test_producer_down_falls_back_to_recompute():
    prof = fast_profile()

    async def main():
        pn = await Node(engine("P", prof)).start()
        dn = await Node(engine("D", prof)).start()
        p, d = pn.engine, dn.engine
        try:
            pr = await produce(p)
            await pn.stop()  # producer's server gone (its engine still holds the pin)
            cr = await d.generate(GenerateRequest("c1", PROMPT, 2, block_hashes=HASHES,
                                                  kv_transfer_params=dict(pr.kv_transfer_params)))
            return (cr, d.metrics.kv_transfer_failures, d.metrics.kv_transfers, d.remote_transfer.pull_failures,
                    d.remote_transfer.last_error, len(p.registry), pn.url)
        finally:
            await dn.close()
            await pn.close()

    cr, failures, transfers, pull_failures, last_error, p_pending, url = asyncio.run(main())
    assert cr.ok and cr.error is None and cr.completion_tokens == 2
    assert cr.external_cached_tokens == 0 and cr.cached_tokens == 0  # recomputed
    assert failures == 1 and transfers == 0 and pull_failures == 1
    assert url + "/query" in last_error
    assert p_pending == 1  # still pinned on the producer until its registry timeout


def test_unknown_transfer_wrong_engine_and_block_size_fall_back():
    prof = fast_profile()

    async def main():
        pn = await Node(engine("P", prof)).start()
        dn = await Node(engine("D", prof)).start()
        d8 = engine("D8", fast_profile(block_size=8), remote_transfer=RemoteTransferClient("D8"))
        dk = engine("DK", fast_profile(kv_bytes_per_token=2000), remote_transfer=RemoteTransferClient("DK"))
        p, d = pn.engine, dn.engine
        try:
            pr = await produce(p)
            params = dict(pr.kv_transfer_params)
            out = []
            for rid, eng, over in (("u", d, {"transfer_id": "nope"}), ("w", d, {"remote_engine_id": "Q"}),
                                   ("b", d8, {}), ("k", dk, {})):
                res = await eng.generate(GenerateRequest(rid, PROMPT, 1, block_hashes=HASHES,
                                                         kv_transfer_params={**params, **over}))
                out.append((res.ok, res.external_cached_tokens, eng.remote_transfer.last_error))
            fails = (d.metrics.kv_transfer_failures, d8.metrics.kv_transfer_failures, dk.metrics.kv_transfer_failures)
            return out, fails, len(p.registry)
        finally:
            await dk.close()
            await d8.close()
            await dn.close()
            await pn.close()

    out, fails, p_pending = asyncio.run(main())
    (ok_u, ext_u, err_u), (ok_w, ext_w, err_w), (ok_b, ext_b, err_b), (ok_k, ext_k, err_k) = out
    assert ok_u and ext_u == 0 and "404" in err_u and "'nope' is unknown or expired" in err_u
    assert ok_w and ext_w == 0 and "engine 'Q' is not served by bootstrap" in err_w
    assert ok_b and ext_b == 0 and "block size 4, this engine 8" in err_b
    assert ok_k and ext_k == 0 and "4000 KV bytes per block, this engine 8000" in err_k
    assert fails == (2, 1, 1)
    assert p_pending == 1  # none of them claimed the real transfer


def test_consumer_with_local_prefix_releases_producer_at_once():
    prof = fast_profile()

    async def main():
        pn = await Node(engine("P", prof)).start()
        dn = await Node(engine("D", prof)).start()
        p, d = pn.engine, dn.engine
        try:
            await d.generate(GenerateRequest("warm", PROMPT, 1, block_hashes=HASHES))  # D has it all locally
            pr = await produce(p)
            cr = await d.generate(GenerateRequest("c1", PROMPT, 1, block_hashes=HASHES,
                                                  kv_transfer_params=dict(pr.kv_transfer_params)))
            await d.remote_transfer.drain()
            return cr, d.metrics.kv_transfers, pinned(p), p.registry.num_leased(), pn.service.releases
        finally:
            await dn.close()
            await pn.close()

    cr, transfers, p_pinned, p_leased, releases = asyncio.run(main())
    assert cr.ok and cr.cached_tokens == 40 and cr.external_cached_tokens == 0
    assert transfers == 0  # nothing to move, but the producer was told to unpin
    assert p_pinned == 0 and p_leased == 0 and releases == 1


def test_consumer_aborted_during_pull_hands_blocks_back():
    prof = fast_profile()
    entered, go = asyncio.Event(), asyncio.Event()

    @web.middleware
    async def hold_pull(request, handler):
        if request.path == "/kv_transfer/pull":  # hold the pull until the consumer has been aborted
            entered.set()
            await go.wait()
        return await handler(request)

    async def main():
        pn = await Node(engine("P", prof), middlewares=[hold_pull]).start()
        dn = await Node(engine("D", prof)).start()
        p, d = pn.engine, dn.engine
        try:
            pr = await produce(p)
            task = asyncio.create_task(d.generate(GenerateRequest(
                "c1", PROMPT, 2, block_hashes=HASHES, kv_transfer_params=dict(pr.kv_transfer_params))))
            await entered.wait()
            aborted = d.abort("c1")
            go.set()
            res = await task
            while d._pull_tasks:  # the pull finishes after the abort; wait for it, then its release
                await asyncio.gather(*d._pull_tasks)
            await d.remote_transfer.drain()
            return (aborted, res, pinned(p), p.registry.num_leased(), len(d.registry), pn.service.pulls,
                    pn.service.releases, d.metrics.kv_transfers)
        finally:
            await dn.close()
            await pn.close()

    aborted, res, p_pinned, p_leased, d_left, pulls, releases, transfers = asyncio.run(main())
    assert aborted and res.error == "aborted" and res.external_cached_tokens == 0
    assert pulls == 1 and releases == 1 and transfers == 0
    assert p_pinned == 0 and p_leased == 0 and d_left == 0


def test_bootstrap_protocol_over_http():
    prof = fast_profile()

    async def main():
        p = engine("P", prof)
        boot = BootstrapServer(p)
        port = await boot.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            pr = await produce(p, tid="t9")
            async with aiohttp.ClientSession() as s:
                async def call(method, path, body=None, raw=None):
                    async with s.request(method, base + path, json=body, data=raw) as resp:
                        return resp.status, await resp.json()

                q = await call("GET", "/query")
                got = await call("POST", "/kv_transfer/pull", {"transfer_id": "t9", "remote_engine_id": "P"})
                again = await call("POST", "/kv_transfer/pull", {"transfer_id": "t9"})
                other = await call("POST", "/kv_transfer/pull", {"transfer_id": "t9", "remote_engine_id": "X"})
                bad = await call("POST", "/kv_transfer/pull", raw=b"{not json")
                missing = await call("POST", "/kv_transfer/release", {})
                leased = pinned(p)
                rel = await call("POST", "/kv_transfer/release", {"transfer_id": "t9"})
                rel2 = await call("POST", "/kv_transfer/release", {"transfer_id": "t9"})
            return pr, p.bootstrap_addr, base, q, got, again, other, bad, missing, leased, rel, rel2, pinned(p)
        finally:
            await boot.close()
            await p.close()

    pr, addr, base, q, got, again, other, bad, missing, leased, rel, rel2, after = asyncio.run(main())
    assert addr == base and pr.kv_transfer_params["remote_bootstrap_addr"] == base
    assert q == (200, {"0": {
        "engine_id": "P", "worker_addr": {"0": {"0": base}}, "block_size": 4, "kv_bytes_per_token": 1000,
        "kv_bytes_per_block": 4000, "num_gpu_blocks": 63, "model": "tiny",
        "pending_transfers": 1, "leased_transfers": 0}})
    assert got == (200, {
        "transfer_id": "t9", "engine_id": "P", "block_size": 4, "kv_bytes_per_block": 4000,
        "block_hashes": list(HASHES), "block_ids": list(range(1, 12)), "num_tokens": PROMPT, "lease_s": 120.0})
    assert again[0] == 404 and "unknown or expired" in again[1]["error"]["message"]
    assert other[0] == 404 and "is not 'X'" in other[1]["error"]["message"]
    assert bad[0] == 400 and "not valid JSON" in bad[1]["error"]["message"]
    assert missing[0] == 400 and "transfer_id" in missing[1]["error"]["message"]
    assert leased == 11  # pulled but not released: still pinned
    assert rel == (200, {"transfer_id": "t9", "released": True})
    assert rel2[0] == 404 and after == 0


def test_registry_lease_runs_out_and_unpins():
    """A consumer that pulled and vanished: the producer's lease frees the blocks (virtual time)."""

    async def main():
        reg = TransferRegistry(timeout_s=120.0)
        freed = []
        reg.register("a", "P", (1, 2), (1, 2), 8, lambda: freed.append("a"))
        reg.register("b", "P", (3,), (3,), 4, lambda: freed.append("b"))
        ea = reg.claim("a", lease_s=5.0)
        eb = reg.claim("b", lease_s=5.0)
        assert ea is not None and eb is not None and reg.num_leased() == 2 and len(reg) == 0
        assert reg.release_leased("b") and freed == ["b"]
        await asyncio.sleep(4.0)
        mid = list(freed)
        await asyncio.sleep(2.0)
        return mid, freed, reg.lease_expired, reg.num_leased(), reg.release_leased("a"), reg.expired

    mid, freed, lease_expired, leased, late, expired = run(main())
    assert mid == ["b"] and freed == ["b", "a"]
    assert lease_expired == 1 and leased == 0 and late is False and expired == 0


def test_emulated_server_mount():
    """The mount instructions on H5's EmulatedServer: PD two-step over /v1/completions."""
    from engines.emulated.server import EmulatedServer

    prof = fast_profile()
    ids = list(range(1000, 1000 + PROMPT))

    async def main():
        servers = {}
        for name in ("P", "D"):
            eng = engine(name, prof)
            srv = EmulatedServer(eng, model="tiny", kv_events_endpoint=None, kv_replay_endpoint=None)
            mount_remote_transfer(srv.app, eng)
            port = await srv.start("127.0.0.1", 0)
            eng.bootstrap_addr = bootstrap_url("127.0.0.1", port)
            servers[name] = (srv, eng, f"http://127.0.0.1:{port}")
        try:
            async with aiohttp.ClientSession() as s:
                async def complete(name, body):
                    async with s.post(servers[name][2] + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        return await resp.json()

                p_out = await complete("P", {"model": "tiny", "prompt": ids, "max_tokens": 1, "kv_transfer_params": {
                    "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t-srv"}})
                ktp = p_out["kv_transfer_params"]
                d_out = await complete("D", {"model": "tiny", "prompt": ids, "max_tokens": 4,
                                             "kv_transfer_params": ktp})
                await servers["D"][1].remote_transfer.drain()
                again = await complete("D", {"model": "tiny", "prompt": ids, "max_tokens": 1})
            p_eng, d_eng = servers["P"][1], servers["D"][1]
            return ktp, d_out, again, pinned(p_eng), d_eng.metrics.kv_transfers, d_eng.metrics.kv_transfer_failures
        finally:
            for srv, eng, _ in servers.values():
                await srv.close()
                await eng.close()

    ktp, d_out, again, p_pinned, transfers, failures = asyncio.run(main())
    assert ktp["remote_engine_id"] == "P" and ktp["transfer_id"] == "t-srv" and ktp["do_remote_prefill"] is True
    assert d_out["usage"]["completion_tokens"] == 4
    assert d_out["usage"]["prompt_tokens_details"]["cached_tokens"] == 40  # all of it pulled from P
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 40  # now a local hit on D
    assert p_pinned == 0 and transfers == 1 and failures == 0
