"""The ``aiohttp`` transport: an aiohttp application around :class:`gateway.http.app.Gateway`.

Kept as the reference implementation the fast transport (:mod:`gateway.http.fast`) is tested
against; chosen with ``transport = "aiohttp"``. aiohttp sets TCP_NODELAY on the sockets it
accepts; :func:`_nodelay` makes sure before a stream starts.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiohttp import web

from gateway.http.app import CHAT, COMPLETIONS, RESET_PREFIX_CACHE

if TYPE_CHECKING:
    from gateway.http.app import Gateway


def _nodelay(request: web.Request) -> None:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class AioDownstream:
    """:class:`~gateway.http.transport.Downstream` over one aiohttp request."""

    __slots__ = ("request", "resp", "started")

    def __init__(self, request: web.Request):
        self.request = request
        self.resp: web.StreamResponse | None = None
        self.started = False

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes, content_type: str) -> None:
        ctype, _, params = content_type.partition(";")
        charset = None
        if "charset=" in params:
            charset = params.split("charset=", 1)[1].strip()
        self.resp = web.Response(body=body, status=status, headers=dict(headers), content_type=ctype.strip(),
                                 charset=charset)

    async def start_stream(self, headers: Mapping[str, str]) -> None:
        resp = web.StreamResponse(status=200, headers=dict(headers))
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        self.resp = resp
        self.started = True
        await resp.prepare(self.request)
        _nodelay(self.request)

    async def write(self, data: bytes) -> None:
        assert self.resp is not None
        await self.resp.write(data)

    async def end(self) -> None:
        assert self.resp is not None
        await self.resp.write_eof()


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.cfg.max_body_bytes)

    def post(endpoint: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            down = AioDownstream(request)
            if request.content_length is not None and request.content_length > gw.cfg.max_body_bytes:
                await gw._send_error(down, gw.body_limit_error(request.content_length), endpoint)
            else:
                try:
                    raw = await request.read()
                except web.HTTPRequestEntityTooLarge:
                    await gw._send_error(down, gw.body_limit_error(None), endpoint)
                else:
                    await gw.handle(endpoint, request.headers, raw, down)
            assert down.resp is not None
            return down.resp

        return handler

    def get(path: str):
        async def handler(request: web.Request) -> web.Response:
            out = gw.get(path)
            assert out is not None
            status, ctype, body = out
            return web.Response(body=body, status=status, content_type=ctype.split(";")[0])

        return handler

    async def reset(request: web.Request) -> web.Response:
        status, ctype, body = await gw.reset_prefix_cache()
        return web.Response(body=body, status=status, content_type=ctype)

    app.add_routes([web.post(COMPLETIONS, post(COMPLETIONS)), web.post(CHAT, post(CHAT)),
                    web.post(RESET_PREFIX_CACHE, reset)]
                   + [web.get(p, get(p)) for p in ("/v1/models", "/health", "/ready", "/metrics", "/debug/state")])
    app.on_startup.append(lambda app: gw.start())
    app.on_cleanup.append(lambda app: gw.close())
    return app
