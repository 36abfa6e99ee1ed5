"""``gpuhit serve`` in front of two real vLLM engines (the session's ``real_vllm_pair``).

The gateway discovers each engine's KV-event sources (vLLM 0.32's object form, ``*`` hosts),
replays their buffers, reads the block size from their ``/metrics``, verifies its block hashes
against theirs, finds their tokenizer (the shipped tiny model's directory) and routes token-id, text
and chat requests; for every request the hit it predicted equals the ``cached_tokens`` vLLM reports.

Ordering without sleeps: KV events reach the gateway asynchronously over ZMQ, so before each next
turn the test waits until the gateway's index holds every full block of the previous prompt on the
engine that served it (a condition on state, polled while yielding to the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.http.app import Gateway
from tests.e2e.helpers import gateway, wait_until

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

MODEL = "tiny"
# KV events cross processes on a machine shared with other jobs: generous, never hit when all is well.
SYNC_TIMEOUT = 60.0


@contextlib.asynccontextmanager
async def real_gateway(pair: Any, tracer: Any = None, **kw: Any) -> AsyncIterator[tuple[Gateway, str]]:
    """An in-process gateway on a free loopback port in front of the pair (engines v0, v1; no
    --block-size, no --tokenizer: both come from the engines)."""
    kw.setdefault("timeout", 120.0)
    kw.setdefault("health_interval", 0.5)
    async with gateway(pair.urls, tracer, name_prefix="v", **kw) as out:
        yield out


async def synced(gw: Gateway) -> None:
    """Every KV-event subscriber has replayed its engine's buffer."""
    for e in gw.engines:
        for s in e.subscribers:
            await asyncio.wait_for(s.synced.wait(), SYNC_TIMEOUT)


async def indexed(gw: Gateway, instance: int, ids: list[int]) -> None:
    """Wait until the gateway's index holds every full block of ``ids`` on ``instance``."""
    hashes = gw.hasher.event_ints(ids)
    cached = gw.router.index.cached
    await wait_until(lambda: all(h in cached(instance) for h in hashes), timeout=SYNC_TIMEOUT,
                     what=f"{len(hashes)} blocks on instance {instance} in the gateway's index")


async def post(http: aiohttp.ClientSession, url: str, path: str, body: dict, session: str | None = None
               ) -> tuple[dict, dict]:
    headers = {"x-session-id": session} if session else {}
    async with http.post(url + path, json=body, headers=headers) as r:
        doc = await r.json(content_type=None)
        assert r.status == 200, doc
        return doc, dict(r.headers)


def _ids_for(gw: Gateway, kind: str, body: dict) -> list[int]:
    """The token ids the gateway (and, if all is right, vLLM) makes of ``body``."""
    if kind == "tokens":
        return body["prompt"]
    assert gw.tokenizer is not None
    return gw.tokenizer.chat_ids(body) if kind == "chat" else gw.tokenizer.completion_ids(body["prompt"], body)


WORDS = ("gateway", "engine", "prefix", "cache", "block", "session", "turn", "agent", "tool", "route", "query",
         "token", "stream", "replay", "trace", "policy", "latency")


def _sentence(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] + str((seed + i) % 13) for i in range(n))


def conversations(kind: str, sessions: int = 2, turns: int = 4) -> list[list[dict]]:
    """Multi-turn request bodies whose prompts grow turn by turn (agentic: each extends the last)."""
    out = []
    for s in range(sessions):
        bodies = []
        if kind == "tokens":
            ids: list[int] = []
            for t in range(turns):
                ids = ids + [(7919 * s + 31 * t + j) % 2000 + 20 for j in range(90 + 37 * t)]
                bodies.append({"model": MODEL, "prompt": list(ids), "max_tokens": 2})
        elif kind == "text":
            text = ""
            for t in range(turns):
                text += _sentence(100 * s + t, 40 + 15 * t) + ". "
                bodies.append({"model": MODEL, "prompt": text, "max_tokens": 2})
        else:
            msgs: list[dict] = [{"role": "system", "content": f"You are agent {s}. " + _sentence(s, 30)}]
            for t in range(turns):
                msgs = msgs + [{"role": "user", "content": _sentence(50 * s + t, 30 + 10 * t)}]
                bodies.append({"model": MODEL, "messages": list(msgs), "max_tokens": 2})
                msgs = msgs + [{"role": "assistant", "content": _sentence(70 * s + t, 12)}]
        out.append(bodies)
    return out


async def run_exact(gw: Gateway, url: str, http: aiohttp.ClientSession, kind: str, tag: str) -> list[tuple[int, int]]:
    """Send ``kind`` conversations (sessions interleaved turn by turn); returns (predicted, cached) per request
    after checking vLLM counted exactly the gateway's prompt tokens."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    convs = conversations(kind)
    rows = []
    for t in range(len(convs[0])):
        for s, bodies in enumerate(convs):
            body = bodies[t]
            ids = _ids_for(gw, kind, body)
            doc, headers = await post(http, url, path, body, session=f"{tag}-{kind}-{s}")
            usage = doc["usage"]
            assert usage["prompt_tokens"] == len(ids), (kind, t, s)  # the gateway tokenized as vLLM did
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            rows.append((int(headers["x-gpuhit-predicted-hit"]), cached))
            inst = [e.name for e in gw.engines].index(headers["x-gpuhit-instance"])
            await indexed(gw, inst, ids)
    return rows


EXACT: dict[str, list[tuple[int, int]]] = {}


def test_exact_hits_for_token_text_and_chat_then_replay_after_restart(real_vllm_pair, caplog):
    """Token-id, text and chat conversations through the gateway: predicted == vLLM's cached_tokens for
    every request; then a fresh gateway learns everything again from the engines' replay buffers."""
    caplog.set_level(logging.WARNING, logger="gateway.hash_check")

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            async with real_gateway(real_vllm_pair, policy="lpwl") as (gw, url):
                await synced(gw)
                assert gw.block_size == real_vllm_pair.block_size  # read from vllm:cache_config_info
                assert gw.tokenizer is not None  # found in the engines' model directory
                for kind in ("tokens", "text", "chat"):
                    EXACT[kind] = await run_exact(gw, url, http, kind, "a")
                state = gw.debug_state()
                checks = state["hash_check"]
                assert all(c["ok"] is not False for c in checks.values()), checks
                assert sum(c["checked"] for c in checks.values()) > 0, checks
                assert state["approximate_prompts"] == {}
                # The gateway's own ZMTP connection to each vLLM publisher: handshake done, batches in.
                streams = [inst["kv_stream"] for inst in state["instances"]]
                assert all(s["connections"] == 1 and s["protocol_errors"] == 0 and s["batches"] > 0
                           for s in streams), streams
                # The gateway read each answer's usage (gateway.http.usage) as vLLM wrote it: its
                # realized-hit counters hold exactly the cached tokens the clients were told.
                told = sum(c for rows in EXACT.values() for _, c in rows)
                realized = sum(gw.metrics.realized_hit.values.values())
                assert realized == told == gw.router.stats.realized_hit_tokens, (realized, told)
                last = conversations("tokens")[0][-1]
                cached_before = [len(gw.router.index.cached(i)) for i in range(2)]
            for kind, rows in EXACT.items():
                assert all(p == c for p, c in rows), (kind, rows)
                assert sum(c for _, c in rows) > 0, kind
            # Gateway restart: a new gateway knows the engines' blocks from their replay buffers alone.
            async with real_gateway(real_vllm_pair, policy="lpwl") as (gw2, url2):
                await synced(gw2)
                await wait_until(lambda: [len(gw2.router.index.cached(i)) for i in range(2)] >= cached_before,
                                 timeout=SYNC_TIMEOUT, what="the replayed index")
                doc, headers = await post(http, url2, "/v1/completions", last, session="after-restart")
                cached = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert cached > 0 and int(headers["x-gpuhit-predicted-hit"]) == cached
        assert not [r for r in caplog.records if "mismatch" in r.getMessage()]
        print("exact hits:", json.dumps({k: f"{sum(p == c for p, c in v)}/{len(v)} requests, "
                                            f"{sum(c for _, c in v)} cached tokens, (predicted, cached): {v}"
                                         for k, v in EXACT.items()}))

    asyncio.run(main())


def test_the_usage_reader_reads_vllms_own_answers(real_vllm_pair):
    """vLLM's non-streamed answers (completion and chat, bytes as it sends them): the tail reader
    finds their usage object, the one the whole answer holds."""
    from gateway.http.usage import TAIL_MAX, usage_from_tail

    async def main() -> None:
        url = real_vllm_pair.urls[0]
        async with aiohttp.ClientSession() as http:
            chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": _sentence(3, 20)}]}
            completion = {"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 2}
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                for _ in range(2):  # the second time with a prefix-cache hit
                    async with http.post(url + path, json=body) as r:
                        raw = await r.read()
                        assert r.status == 200, raw[:300]
                    tail = raw[-TAIL_MAX:]
                    got = usage_from_tail(tail, sse=False)
                    assert got is not None and got == json.loads(raw)["usage"]

    asyncio.run(main())


def test_seed_mismatch_is_detected_and_reported(real_vllm_pair):
    """A gateway told the engines run with PYTHONHASHSEED=0 (they do not): its hashes differ from theirs,
    which it says in /debug/state, /metrics and the log instead of silently predicting no hits."""

    async def main() -> None:
        async with aiohttp.ClientSession() as http, real_gateway(real_vllm_pair, hash_seed="0") as (gw, url):
            await synced(gw)
            prompt = [(13 * j) % 1900 + 50 for j in range(200)]
            # Three sends: with every predicted hit 0 the tie-break alternates engines, so one engine
            # sees the prompt twice and serves it from its cache.
            answers = [await post(http, url, "/v1/completions",
                                  {"model": MODEL, "prompt": prompt, "max_tokens": 2}, session="seed")
                       for _ in range(3)]
            assert any(doc["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for doc, _ in answers)
            # the index cannot match a differently seeded chain
            assert all(headers["x-gpuhit-predicted-hit"] == "0" for _, headers in answers)
            await wait_until(lambda: any(c["mismatches"] > 0 for c in gw.debug_state()["hash_check"].values()),
                             timeout=SYNC_TIMEOUT, what="a hash mismatch")
            checks = gw.debug_state()["hash_check"]
            bad = [c for c in checks.values() if c["mismatches"]]
            assert bad and all(c["ok"] is False and "--hash-seed" in c["last_mismatch"] for c in bad)
            async with http.get(url + "/metrics") as r:
                text = await r.text()
            assert any(line.startswith("gpuhit_gateway_kv_hash_checks_total") and 'outcome="mismatch"' in line
                       and not line.endswith(" 0") for line in text.splitlines())

    asyncio.run(main())


def test_metrics_scrape_reads_vllm_gauges(real_vllm_pair):
    async def main() -> None:
        async with real_gateway(real_vllm_pair) as (gw, _url):
            for e in gw.engines:
                st = e.stats()
                assert st.block_size == real_vllm_pair.block_size
                assert st.running is not None and st.waiting is not None
                assert st.kv_usage is not None and 0.0 <= st.kv_usage <= 1.0
                assert st.kv_capacity_blocks and st.kv_capacity_blocks > 1000  # 1 GiB of KV for the tiny model
            assert gw.max_model_len == real_vllm_pair.max_model_len

    asyncio.run(main())


def test_a_vllm_error_answer_is_relayed_as_vllm_sent_it(real_vllm_pair):
    """A request the gateway routes but vLLM refuses (``kv_transfer_params`` not an object: vLLM's
    pydantic 400): status, content-type and body reach the client exactly as vLLM sent them, streamed
    or not, with the gateway's decision headers; the router's counters are released and the error
    counted against the engine."""
    async def main() -> None:
        async with aiohttp.ClientSession() as http, real_gateway(real_vllm_pair, policy="lpwl") as (gw, url):
            for stream in (False, True):
                body = {"model": MODEL, "prompt": list(range(100, 180)), "max_tokens": 2, "stream": stream,
                        "kv_transfer_params": 5}
                async with http.post(url + "/v1/completions", json=body) as r:
                    got = (r.status, r.headers["content-type"], await r.read())
                    inst = r.headers["x-gpuhit-instance"]
                    assert r.headers["x-gpuhit-decision"] == "forward"
                direct_url = real_vllm_pair.urls[[e.name for e in gw.engines].index(inst)]
                async with http.post(direct_url + "/v1/completions", json=body) as r:
                    want = (r.status, r.headers["content-type"], await r.read())
                assert want[0] == 400 and want[1] == "application/json", want
                assert got == want, (stream, got, want)
                assert json.loads(got[2])["error"]["code"] == 400
            assert sum(gw.metrics.upstream_errors.values.get((e.name, "status"), 0) for e in gw.engines) == 2
            assert gw.metrics.requests.get(("/v1/completions", "400")) == 2
            assert all(c["in_flight"] == c["pending_prefill_tokens"] == 0 for c in gw.router.counters())

    asyncio.run(main())
