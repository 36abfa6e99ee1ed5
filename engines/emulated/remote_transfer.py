"""PD / migration KV transfer between emulated engines in different processes, over HTTP.

With ``gpuhit emulate`` every engine is its own process, so a consumer cannot reach the producer's
in-process :class:`~engines.emulated.kv_transfer.TransferRegistry`. This module mirrors what vLLM's
``MooncakeConnector`` does instead:

* The producer serves a **bootstrap** endpoint (vLLM: ``VLLM_MOONCAKE_BOOTSTRAP_PORT``, default
  8998). ``GET /query`` answers in vLLM's shape, ``{dp_rank: {"engine_id": E, "worker_addr":
  {tp_rank: {pp_rank: addr}}}}`` (JSON keys are strings), plus the emulator's extras in the same
  dp entry (``block_size``, ``kv_bytes_per_token``, ``kv_bytes_per_block``, ...), which vLLM's
  consumer ignores. ``addr`` is where the consumer pulls from (vLLM: the worker's ZMQ side channel;
  here the producer's own HTTP base URL).
* The consumer, seeing ``kv_transfer_params`` with ``do_remote_prefill`` / ``remote_engine_id`` /
  ``remote_bootstrap_addr`` / ``transfer_id``, queries the bootstrap address once per producer
  (cached, like vLLM's ``_remote_agents``), checks the engine id is served there, then pulls the
  transfer: ``POST {addr}/kv_transfer/pull {"transfer_id": T, ...}`` answers the pinned blocks'
  hashes, ids and token count (vLLM: ``MooncakeXferMetadata`` over ZMQ, then the Mooncake write).
  No KV bytes travel: the emulator has none. The NIC time is charged by the consumer engine in
  loop time, exactly as for an in-process transfer (``profile.transfer_time``).
* When the consumer's load has landed (or it gives up on the transfer) it tells the producer:
  ``POST {addr}/kv_transfer/release {"transfer_id": T}``, and the producer unpins the blocks (vLLM:
  ``finished_sending``). A pull claims the producer's entry with a lease (the registry timeout), so a
  consumer that dies between pull and release does not pin the producer's cache forever.

Failures (producer down, engine id not served at that address, transfer unknown or expired,
block size mismatch, malformed answers) never fail the consumer's request: the pull returns None,
the engine counts ``kv_transfer_failures`` and recomputes the prompt, and the client keeps the
reason in ``last_error`` and logs a warning.

Mount instructions (producer side, in the engine's own aiohttp server)::

    mount_remote_transfer(app, engine)                  # before the app starts
    ... start the site, learn the port ...
    engine.bootstrap_addr = bootstrap_url(advertise_host, port)

or run the bootstrap service on its own port like vLLM (``BootstrapServer(engine).start(host,
8998)``, which also sets ``engine.bootstrap_addr``) and give the engine a client with
``engine.remote_transfer = RemoteTransferClient(engine.name)``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from engines.emulated.kv_transfer import TransferEntry, TransferRegistry
from gpuhit.errors import BadRequestError, GpuhitError, NotFoundError, TransferError

if TYPE_CHECKING:
    from engines.emulated.engine import EmulatedEngine

log = logging.getLogger(__name__)

DEFAULT_BOOTSTRAP_PORT = 8998  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default
QUERY_PATH = "/query"
PULL_PATH = "/kv_transfer/pull"
RELEASE_PATH = "/kv_transfer/release"


def bootstrap_url(host: str, port: int) -> str:
    """``http://host:port`` as a consumer dials it (IPv6 literals bracketed)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


# ------------------------------------------------------------------------------------ producer


def _error(exc: GpuhitError) -> web.Response:
    return web.json_response(
        {"error": {"message": str(exc), "type": exc.code, "code": exc.http_status}}, status=exc.http_status
    )


async def _transfer_id_of(request: web.Request) -> tuple[str, Mapping[str, Any]]:
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, Mapping):
        raise BadRequestError("request body must be a JSON object")
    tid = body.get("transfer_id")
    if not isinstance(tid, str) or not tid:
        raise BadRequestError("transfer_id (a non-empty string) is required")
    return tid, body


class BootstrapService:
    """The producer's bootstrap + pull + release handlers for one engine.

    ``lease_s``: how long a pulled transfer stays pinned waiting for the consumer's release (default:
    the engine registry's timeout, vLLM's ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` analogue).
    """

    def __init__(self, engine: EmulatedEngine, lease_s: float | None = None):
        self.engine = engine
        self.lease_s = lease_s
        self.pulls = 0
        self.pull_misses = 0
        self.releases = 0

    @property
    def registry(self) -> TransferRegistry:
        return self.engine.registry

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get(QUERY_PATH, self.query),
            web.post(PULL_PATH, self.pull),
            web.post(RELEASE_PATH, self.release),
        ]

    async def query(self, request: web.Request) -> web.Response:
        e = self.engine
        # The consumer reached us through request.host, so it can reach the pull endpoint there too.
        addr = f"{request.scheme}://{request.host}"
        entry = {
            "engine_id": e.name,
            "worker_addr": {"0": {"0": addr}},
            "block_size": e.block_size,
            "kv_bytes_per_token": e.profile.kv_bytes_per_token,
            "kv_bytes_per_block": e.block_bytes,
            "num_gpu_blocks": e.pool.num_usable,
            "model": e.model_name,
            "pending_transfers": len(self.registry),
            "leased_transfers": self.registry.num_leased(),
        }
        return web.json_response({"0": entry})

    async def pull(self, request: web.Request) -> web.Response:
        try:
            tid, body = await _transfer_id_of(request)
            want = body.get("remote_engine_id")
            e = self.engine
            if want is not None and want != e.name:
                raise NotFoundError(f"engine {e.name!r} is not {want!r}: transfer {tid!r} is not here")
            lease = self.lease_s if self.lease_s is not None else self.registry.timeout_s
            entry = self.registry.claim(tid, lease_s=lease)
            if entry is None:
                self.pull_misses += 1
                raise NotFoundError(f"transfer {tid!r} is unknown or expired on engine {e.name!r}")
        except GpuhitError as exc:
            return _error(exc)
        self.pulls += 1
        return web.json_response({
            "transfer_id": tid,
            "engine_id": entry.engine_name,
            "block_size": e.block_size,
            "kv_bytes_per_block": e.block_bytes,
            "block_hashes": list(entry.block_hashes),
            "block_ids": list(entry.block_ids),
            "num_tokens": entry.num_tokens,
            "lease_s": lease,
        })

    async def release(self, request: web.Request) -> web.Response:
        try:
            tid, _ = await _transfer_id_of(request)
            if not self.registry.release_leased(tid):
                raise NotFoundError(
                    f"transfer {tid!r} is not leased on engine {self.engine.name!r} (released or lease over)")
        except GpuhitError as exc:
            return _error(exc)
        self.releases += 1
        return web.json_response({"transfer_id": tid, "released": True})


def bootstrap_routes(engine: EmulatedEngine, lease_s: float | None = None) -> list[web.RouteDef]:
    """``GET /query``, ``POST /kv_transfer/pull``, ``POST /kv_transfer/release`` for ``engine``."""
    return BootstrapService(engine, lease_s).routes()


def mount_remote_transfer(
    app: web.Application, engine: EmulatedEngine, *, lease_s: float | None = None, http_timeout_s: float = 10.0
) -> BootstrapService:
    """Serve ``engine``'s bootstrap routes on ``app`` and give the engine a consumer client.

    Both sides at once because an engine that has its own server is, by that fact, in its own
    process: it can only reach other engines' transfers over HTTP (vLLM's ``kv_both``). The
    client is closed with the app. Set ``engine.bootstrap_addr`` once the port is known.
    """
    svc = BootstrapService(engine, lease_s)
    app.add_routes(svc.routes())
    if engine.remote_transfer is None:
        engine.remote_transfer = RemoteTransferClient(engine.name, http_timeout_s=http_timeout_s)
    client = engine.remote_transfer

    async def _close_client(_app: web.Application) -> None:
        await client.close()

    app.on_cleanup.append(_close_client)
    return svc


class BootstrapServer:
    """The bootstrap service alone on its own port (vLLM's bootstrap server, default port 8998)."""

    def __init__(self, engine: EmulatedEngine, lease_s: float | None = None):
        self.engine = engine
        self.service = BootstrapService(engine, lease_s)
        self.app = web.Application()
        self.app.add_routes(self.service.routes())
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self, host: str = "127.0.0.1", port: int = DEFAULT_BOOTSTRAP_PORT,
                    advertise_host: str | None = None) -> int:
        """Serve on ``host:port`` (0 = any free port); sets ``engine.bootstrap_addr``; returns the port."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        self.port = int(self._runner.addresses[0][1])
        self.engine.bootstrap_addr = bootstrap_url(advertise_host or host, self.port)
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


# ------------------------------------------------------------------------------------ consumer


@dataclass(frozen=True, slots=True)
class RemoteAgent:
    """One producer as its bootstrap ``/query`` describes it."""

    engine_id: str
    pull_base: str  # http://host:port the pull/release endpoints live under
    block_size: int | None
    kv_bytes_per_block: int | None


class RemoteTransferClient:
    """The consumer side: pulls a remote producer's pinned transfer into the local registry.

    One per consumer engine (the engine closes it). ``http_timeout_s`` bounds each HTTP call so a
    hung producer turns into a counted fallback, not a stuck request.
    """

    def __init__(self, engine_id: str, *, http_timeout_s: float = 10.0,
                 session: aiohttp.ClientSession | None = None):
        self.engine_id = engine_id
        self.http_timeout_s = http_timeout_s
        self._session = session
        self._own_session = session is None
        self._agents: dict[str, dict[str, RemoteAgent]] = {}  # bootstrap addr -> engine id -> agent
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.pulls = 0
        self.pull_failures = 0
        self.releases = 0
        self.release_failures = 0
        self.last_error: str | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise TransferError(f"the remote transfer client of engine {self.engine_id!r} is closed")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.http_timeout_s))
            self._own_session = True
        return self._session

    async def _json(self, method: str, url: str, body: Mapping[str, Any] | None = None) -> Any:
        try:
            async with self._http().request(method, url, json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise TransferError(f"{method} {url} answered {resp.status}: {text[:300]}")
                return json.loads(text)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise TransferError(f"{method} {url} failed: {exc!r}") from None

    async def _agent(self, addr: str, engine_id: str | None) -> RemoteAgent:
        agents = self._agents.get(addr)
        if agents is None or (engine_id is not None and engine_id not in agents):
            data = await self._json("GET", addr + QUERY_PATH)
            agents = {}
            try:
                for dp in data.values():
                    workers = dp["worker_addr"]
                    tp0 = workers.get("0") or next(iter(workers.values()))
                    base = tp0.get("0") or next(iter(tp0.values()))
                    bs = dp.get("block_size")
                    bb = dp.get("kv_bytes_per_block")
                    agents[str(dp["engine_id"])] = RemoteAgent(
                        str(dp["engine_id"]), str(base).rstrip("/"), int(bs) if bs is not None else None,
                        int(bb) if bb is not None else None)
            except (AttributeError, KeyError, StopIteration, TypeError, ValueError) as exc:
                raise TransferError(f"bootstrap {addr}{QUERY_PATH} answered an unexpected shape: {exc!r}") from None
            self._agents[addr] = agents
        if engine_id is None:
            if len(agents) != 1:
                raise TransferError(f"bootstrap {addr} serves {sorted(agents)}; kv_transfer_params names none")
            return next(iter(agents.values()))
        agent = agents.get(engine_id)
        if agent is None:
            raise TransferError(f"engine {engine_id!r} is not served by bootstrap {addr} (it serves {sorted(agents)})")
        return agent

    async def pull(self, params: Mapping[str, Any], block_size: int, registry: TransferRegistry,
                   block_bytes: int | None = None) -> TransferEntry | None:
        """Claim ``params["transfer_id"]`` from the producer at ``params["remote_bootstrap_addr"]``
        and register it in ``registry`` (the consumer engine's), whose entry's ``release()`` tells
        the producer to unpin. None on any failure (reason in ``last_error``).

        ``block_size`` / ``block_bytes`` are the consumer's: a producer with another block layout
        (another block size or model) cannot hand over its blocks, as in vLLM."""
        tid = str(params.get("transfer_id"))
        addr = str(params.get("remote_bootstrap_addr", "")).rstrip("/")
        want = params.get("remote_engine_id")
        want = None if want is None else str(want)
        try:
            agent = await self._agent(addr, want)
            if agent.block_size is not None and agent.block_size != block_size:
                raise TransferError(f"producer {agent.engine_id!r} uses block size {agent.block_size}, "
                                    f"this engine {block_size}: its blocks cannot be reused")
            if (block_bytes is not None and agent.kv_bytes_per_block is not None
                    and agent.kv_bytes_per_block != block_bytes):
                raise TransferError(f"producer {agent.engine_id!r} has {agent.kv_bytes_per_block} KV bytes per "
                                    f"block, this engine {block_bytes}: not the same model's KV")
            data = await self._json("POST", agent.pull_base + PULL_PATH, {
                "transfer_id": tid, "remote_engine_id": agent.engine_id, "engine_id": self.engine_id})
            try:
                hashes = tuple(int(h) for h in data["block_hashes"])
                ids = tuple(int(b) for b in data["block_ids"])
                num_tokens = int(data["num_tokens"])
                lease = float(data.get("lease_s") or registry.timeout_s)
            except (KeyError, TypeError, ValueError) as exc:
                self._forget(addr)
                self._spawn_release(agent.pull_base, tid)
                raise TransferError(f"producer {agent.engine_id!r} answered an unexpected pull: {exc!r}") from None
        except TransferError as exc:
            self._forget(addr)
            self.pull_failures += 1
            self.last_error = str(exc)
            log.warning("KV transfer %s for engine %s falls back to recompute: %s", tid, self.engine_id, exc)
            return None
        self.pulls += 1
        base = agent.pull_base
        # Expire our proxy no later than the producer's lease, so we never count KV it already freed.
        return registry.register(tid, agent.engine_id, hashes, ids, num_tokens,
                                 lambda: self._spawn_release(base, tid),
                                 timeout_s=min(registry.timeout_s, lease))

    def _forget(self, addr: str) -> None:
        # The producer may have restarted under another engine id: query again next time.
        self._agents.pop(addr, None)

    def _spawn_release(self, base: str, tid: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.release_failures += 1
            self.last_error = f"release of transfer {tid!r} outside an event loop: the producer's lease frees it"
            return
        task = loop.create_task(self._release(base, tid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, base: str, tid: str) -> None:
        try:
            await self._json("POST", base + RELEASE_PATH, {"transfer_id": tid, "engine_id": self.engine_id})
        except TransferError as exc:
            # Nothing is lost: the producer's lease unpins the blocks when it runs out.
            self.release_failures += 1
            self.last_error = str(exc)
            log.warning("KV transfer %s: release to producer failed (its lease will free it): %s", tid, exc)
            return
        self.releases += 1

    async def drain(self) -> None:
        """Wait until every release sent so far has been answered (tests, orderly shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Send the outstanding releases, then close the HTTP session (idempotent)."""
        if self._closed:
            return
        await self.drain()
        self._closed = True
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None
