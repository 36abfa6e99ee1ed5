"""The producer step of vLLM's connector two-step, for decisions that move KV (MIGRATE / FETCH / PD).

Step (1): the producer request to the source (not streamed, ``max_tokens`` = ``min_tokens`` = 1,
``kv_transfer_params`` with ``do_remote_decode`` and the router's ``transfer_id``), as vLLM's
disaggregation proxies send it. Its answer, completed, is the consumer's ``kv_transfer_params``
(``do_remote_prefill``, ``remote_engine_id``, ``remote_bootstrap_addr``, ``transfer_id``) that step
(2), the client's request to the target, carries. The bootstrap address is the engine's configured
``bootstrap`` (vLLM's Mooncake bootstrap server, whose ``GET /query`` names the engine id) or else
what the producer returned (the emulator returns both). A failed producer step is counted
(``gpuhit_gateway_kv_moves_total{outcome="producer_failed"}``) and the target recomputes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson

from engines.base import GenerateResult
from engines.vllm import protocol
from gateway import breaker
from gateway.http.forward_breakers import Breakers
from gateway.http.transport import COMPLETIONS, Upstream
from gateway.metrics import GatewayMetrics
from gateway.router import Ticket
from gpuhit.errors import EngineError

# What a NixlConnector producer returns for its consumer (vLLM 0.32, engines/vllm/pd_check.py).
_NIXL_PARAMS = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")


class ProducerStep:
    """Runs step (1) on a ticket's source. ``bootstraps``: each engine's configured bootstrap
    address (or None); ``session``: for the bootstrap servers' ``GET /query``; ``limit``: seconds
    the producer request may take (None: no limit)."""

    def __init__(self, upstream: Upstream, session: aiohttp.ClientSession | None, names: Sequence[str],
                 bootstraps: Sequence[str | None], breakers: Breakers | None, metrics: GatewayMetrics,
                 model: str, limit: float | None):
        self.upstream = upstream
        self.session = session
        self.names = list(names)
        self.bootstraps = list(bootstraps)
        self.breakers = breakers
        self.metrics = metrics
        self.model = model
        self.limit = limit
        self._engine_ids: dict[str, str] = {}  # bootstrap address -> engine id (its GET /query)

    async def __call__(self, ticket: Ticket, up_headers: Mapping[str, str]) -> Mapping[str, Any] | None:
        """The consumer's kv_transfer_params, or None after a (counted) failure: the target then
        recomputes."""
        src = ticket.source
        assert src is not None
        preq = ticket.producer_request()
        action = ticket.action
        m = self.metrics
        if preq.prompt_token_ids is None:
            m.kv_moves.inc((action, "producer_failed"))
            return ticket.producer_done(None, "KV-moving actions need token-id prompts")
        body = {"model": self.model, "prompt": list(preq.prompt_token_ids), "max_tokens": 1, "min_tokens": 1,
                "ignore_eos": True, "stream": False, "kv_transfer_params": dict(preq.kv_transfer_params or {})}
        if ticket.decision.producer_priority is not None:  # e.g. a migration's export ahead of the backlog
            body["priority"] = ticket.decision.producer_priority
        res = GenerateResult(request_id=preq.request_id, prompt_tokens=preq.prompt_len)
        name = self.names[src]
        limit = self.limit
        try:
            try:
                async with asyncio.timeout(limit):
                    up = await self.upstream.post(src, COMPLETIONS, orjson.dumps(body),
                                                  {**up_headers, "x-request-id": preq.request_id})
                    try:
                        data = await up.read()
                    finally:
                        up.release()
            except TimeoutError:
                why = f"no answer within {limit:g} s"
                if self.breakers is not None:
                    self.breakers.failed(src, breaker.TIMEOUT, f"producer step: {why}")
                raise EngineError(why) from None
            if up.status != 200:
                raise EngineError(f"HTTP {up.status}: {data[:300].decode(errors='replace')}")
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                raise EngineError(f"answered invalid JSON: {exc}") from None
            returned = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
            u = doc.get("usage") if isinstance(doc, dict) else None
            res.cached_tokens = protocol.cached_tokens_of(u) or 0
            res.completion_tokens = int(u.get("completion_tokens") or 0) if isinstance(u, dict) else 0
            res.kv_transfer_params = await self.consumer_params(src, ticket.transfer_id or "", returned)
        except EngineError as exc:
            m.kv_moves.inc((action, "producer_failed"))
            m.upstream_errors.inc((name, "producer"))
            return ticket.producer_done(None, f"producer {name}: {exc}")
        return ticket.producer_done(res)

    async def consumer_params(self, src: int, transfer_id: str, returned: Any) -> dict[str, Any]:
        """The consumer's kv_transfer_params for a transfer produced on ``src``: what the producer
        returned (the emulator returns everything), completed from the engine's configured bootstrap
        address and the engine id its ``GET /query`` names (vLLM's Mooncake producer returns none)."""
        params = dict(returned) if isinstance(returned, Mapping) else {}
        params["do_remote_prefill"] = True
        params["do_remote_decode"] = False
        if all(params.get(k) is not None for k in _NIXL_PARAMS):
            # vLLM's NixlConnector (the one its CPU build runs) returns all its consumer needs
            # (engine id, side-channel host/port, block ids): no bootstrap server, passed as is.
            return params
        params.setdefault("transfer_id", transfer_id)
        configured = self.bootstraps[src]
        if configured is not None:
            addr = configured.rstrip("/")
            if params.get("remote_bootstrap_addr") != addr or not params.get("remote_engine_id"):
                params["remote_engine_id"] = await self._engine_id(addr)
            params["remote_bootstrap_addr"] = addr
        elif not params.get("remote_bootstrap_addr") or not params.get("remote_engine_id"):
            raise EngineError(f"returned no remote_bootstrap_addr / remote_engine_id and no bootstrap address is "
                              f"configured for engine {self.names[src]} (set bootstrap = "
                              f"\"http://host:8998\" in its [[engines]] entry, or --bootstrap)")
        return params

    async def _engine_id(self, addr: str) -> str:
        known = self._engine_ids.get(addr)
        if known is not None:
            return known
        assert self.session is not None
        try:
            async with self.session.get(addr + "/query", timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                doc = await r.json(content_type=None)
            first = doc.get("0") if "0" in doc else next(iter(doc.values()))
            eid = str(first["engine_id"])
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError, KeyError, StopIteration,
                TypeError) as exc:
            raise EngineError(f"bootstrap {addr}/query gave no engine id: {exc!r}") from None
        self._engine_ids[addr] = eid
        return eid
