"""Shared routing state between ``gpuhit serve`` replicas over Redis pub/sub (``--share redis://``).

Each replica publishes its :class:`gateway.share.ShareLink` state messages (its own per-instance
totals of pending prefill, in-flight, decoding, active blocks and routed requests, plus the session
bindings it changed) on one channel and applies everyone else's. Redis pub/sub delivers a message
to the subscribers connected at the time, in publish order per connection: a replica that starts
late, or misses messages during an outage, is right again after each peer's next message, because
messages carry totals, not deltas (bindings made meanwhile are the one thing it does not learn).

Timing: a decision's changes are coalesced into one message (the publisher wakes once per batch of
changes); every replica also republishes its totals each ``heartbeat_s``, and drops a peer not heard
from for ``peer_timeout_s`` (a crashed replica's work is no longer counted) — its graceful exit
sends ``bye`` instead.

Failure is loud, never silent: an unreachable server at start is a :class:`~gpuhit.errors.ConfigError`
(``gpuhit serve`` exits 2); a server lost later is logged as an error, shown in ``/debug/state``
(``share.connected`` false with the reason) and in ``/metrics`` (``gpuhit_gateway_share_connected``
0), and the replica keeps routing on what it knows, retrying every ``retry_s``, until the server
is back (logged again). Time is the running loop's (``loop.time()``), as everywhere in the gateway.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from collections.abc import Iterable
from typing import Any

import orjson

from gateway.share import ShareLink
from gpuhit.errors import ConfigError

log = logging.getLogger("gpuhit.gateway.share")

DEFAULT_CHANNEL = "gpuhit:share"


def _redis() -> Any:
    try:
        import redis.asyncio as aioredis
    except ImportError:
        raise ConfigError("--share redis://... needs the Redis client: pip install 'gpuhit[share]' (PyPI redis)") from None
    return aioredis


class RedisShare:
    """One replica's connection to the shared state (see the module docstring)."""

    def __init__(self, url: str, router: Any, *, channel: str = DEFAULT_CHANNEL, replica_id: str | None = None,
                 heartbeat_s: float = 1.0, peer_timeout_s: float = 5.0, retry_s: float = 1.0,
                 connect_timeout_s: float = 5.0, history: Any = None):
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"--share must be a redis://host:port URL, got {url!r}")
        if not (heartbeat_s > 0 and peer_timeout_s > heartbeat_s and retry_s > 0):
            raise ConfigError("shared state needs heartbeat_s > 0, peer_timeout_s > heartbeat_s and retry_s > 0")
        self.url = url
        self.channel = channel
        # Unique per process: a restarted replica is a new peer, and its old totals expire.
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.retry_s = retry_s
        self.connect_timeout_s = connect_timeout_s
        self.router = router
        # history: the gateway's stored-Responses map (gateway.dialects.history), shared too.
        self.link = ShareLink(router, self.replica_id, self._dirty, history=history)
        self.connected = False
        self.error: str | None = None
        self.outages = 0
        self.publish_errors = 0
        self._wake = asyncio.Event()
        self._client: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False

    def _dirty(self) -> None:
        self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and subscribe; an unreachable server is a ConfigError (nothing is started)."""
        aioredis = _redis()
        from redis.exceptions import RedisError

        self._client = aioredis.from_url(self.url, socket_connect_timeout=self.connect_timeout_s,
                                         socket_timeout=None, retry_on_timeout=False)
        try:
            pubsub = await self._subscribe()
        except (RedisError, OSError) as exc:
            await self._client.aclose()
            self._client = None
            raise ConfigError(f"--share {self.url}: the message server is not reachable: {exc}") from None
        self.connected = True
        log.info("shared state: replica %s on %s channel %s", self.replica_id, self.url, self.channel)
        self._tasks = [asyncio.ensure_future(self._reader(pubsub)), asyncio.ensure_future(self._publisher()),
                       asyncio.ensure_future(self._heartbeat())]
        self._wake.set()  # announce ourselves (and our totals) at once

    async def _subscribe(self) -> Any:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await asyncio.wait_for(pubsub.subscribe(self.channel), self.connect_timeout_s)
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def close(self) -> None:
        """Say ``bye`` (best effort: peers would expire us anyway) and stop."""
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        # Cancelled, they end with CancelledError; an error of theirs was logged where it happened.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            from redis.exceptions import RedisError

            if self.connected:
                try:
                    await asyncio.wait_for(self._client.publish(self.channel, orjson.dumps(self.link.bye())),
                                           self.connect_timeout_s)
                except (RedisError, OSError, TimeoutError):
                    pass
            await self._client.aclose()

    # -- the three tasks ---------------------------------------------------------------------------

    async def _reader(self, pubsub: Any) -> None:
        from redis.exceptions import RedisError

        loop = asyncio.get_running_loop()
        while True:
            try:
                while True:
                    m = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                    if m is None or m.get("type") != "message":
                        continue
                    try:
                        self.link.receive(orjson.loads(m["data"]), now=loop.time())
                    except (ConfigError, ValueError, KeyError, TypeError) as exc:
                        log.error("shared state: ignored a bad message on %s: %s", self.channel, exc)
            except (RedisError, OSError) as exc:
                self._down(exc)
            try:
                await pubsub.aclose()
            except (RedisError, OSError):
                pass
            pubsub = await self._reconnect()

    async def _reconnect(self) -> Any:
        from redis.exceptions import RedisError

        while True:
            await asyncio.sleep(self.retry_s)
            try:
                pubsub = await self._subscribe()
            except (RedisError, OSError, TimeoutError):
                continue
            self.connected = True
            self.error = None
            log.warning("shared state: the message server %s is back; sharing with the other replicas again", self.url)
            self._wake.set()
            return pubsub

    async def _publisher(self) -> None:
        from redis.exceptions import RedisError

        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.connected:
                continue  # the reader reconnects and wakes us; our totals go out then
            msg = self.link.message()
            try:
                await self._client.publish(self.channel, orjson.dumps(msg))
            except (RedisError, OSError) as exc:
                self.publish_errors += 1
                self.link.requeue(msg)
                self._down(exc)

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._wake.set()
            for peer in self.link.expire(loop.time(), self.peer_timeout_s):
                log.warning("shared state: replica %s silent for %.0f s: its in-flight work is no longer counted",
                            peer, self.peer_timeout_s)

    def _down(self, exc: BaseException) -> None:
        if self.connected:
            self.outages += 1
            log.error("shared state: lost the message server %s (%s: %s); this replica routes on its own counters "
                      "and the last totals of its peers until it is back", self.url, type(exc).__name__, exc)
        self.connected = False
        self.error = f"{type(exc).__name__}: {exc}"

    # -- reporting ---------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """For ``/debug/state``."""
        return {"url": self.url, "channel": self.channel, "replica_id": self.replica_id, "connected": self.connected,
                "error": self.error, "outages": self.outages, "peers": self.link.peers,
                "messages_in": self.link.messages_in, "messages_out": self.link.messages_out,
                "publish_errors": self.publish_errors, "responses_in": self.link.responses_in,
                "responses_out": self.link.responses_out, "responses_trimmed": self.link.responses_trimmed}

    def render(self) -> Iterable[Any]:
        """``gpuhit_gateway_share_connected`` and ``gpuhit_gateway_share_peers`` gauges (``/metrics``)."""
        from prometheus_client.core import GaugeMetricFamily

        c = GaugeMetricFamily("gpuhit_gateway_share_connected",
                              "1 while the shared-state message server (--share) is reachable, else 0.")
        c.add_metric([], 1.0 if self.connected else 0.0)
        yield c
        p = GaugeMetricFamily("gpuhit_gateway_share_peers", "Other gateway replicas whose state this one counts.")
        p.add_metric([], float(len(self.link.peers)))
        yield p
