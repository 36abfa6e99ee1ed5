"""The ``aiohttp`` transport: an aiohttp application around the gateway's request logic
(:class:`gateway.http.handler.Handler`).

Kept as the reference implementation the fast transport (:mod:`gateway.http.fast`) is tested
against; chosen with ``transport = "aiohttp"``. aiohttp sets TCP_NODELAY on the sockets it
accepts; :func:`_nodelay` makes sure before a stream starts.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from gateway.http.handler import Handler
from gateway.http.parse import PROMPT_PATHS
from gateway.http.transport import (
    GET_PATHS,
    RESET_PREFIX_CACHE,
    MethodNotAllowedError,
    RequestTimeoutError,
)
from gpuhit.errors import BadRequestError, GpuhitError, NotFoundError


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


def build_app(gw: Handler) -> web.Application:
    cfg = gw.cfg
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[_guard(gw)])

    def post(endpoint: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            down = AioDownstream(request)
            if request.content_length is not None and request.content_length > cfg.max_body_bytes:
                await gw.replies.send(down, gw.body_limit_error(request.content_length), endpoint)
            else:
                try:
                    async with asyncio.timeout(cfg.body_timeout):
                        raw = await request.read()
                except web.HTTPRequestEntityTooLarge:
                    await gw.replies.send(down, gw.body_limit_error(None), endpoint)
                except TimeoutError:
                    err = RequestTimeoutError(f"request body not received within {cfg.body_timeout:g} s")
                    await gw.replies.send(down, err, endpoint)
                    assert down.resp is not None
                    down.resp.force_close()
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
            return web.Response(body=body, status=status, headers={"Content-Type": ctype})

        return handler

    async def reset(request: web.Request) -> web.Response:
        status, ctype, body = await gw.reset_prefix_cache()
        return web.Response(body=body, status=status, content_type=ctype)

    async def other(request: web.Request) -> web.StreamResponse:
        """Any other route: forwarded to an engine (gateway.http.passthrough)."""
        path = request.path
        if path in PROMPT_PATHS or path in GET_PATHS or path == RESET_PREFIX_CACHE:  # the gateway's own
            raise web.HTTPMethodNotAllowed(request.method, [])
        down = AioDownstream(request)
        try:
            async with asyncio.timeout(cfg.body_timeout):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            await gw.replies.send(down, gw.body_limit_error(None), "other")
        else:
            query = "?" + request.query_string if request.query_string else ""
            assert gw.passthrough is not None
            await gw.passthrough.handle(request.method, request.path, query, request.headers, raw, down)
        assert down.resp is not None
        return down.resp

    app.add_routes([web.post(p, post(p)) for p in PROMPT_PATHS] + [web.post(RESET_PREFIX_CACHE, reset)]
                   + [web.get(p, get(p)) for p in GET_PATHS] + [web.route("*", "/{tail:.*}", other)])
    app.on_startup.append(lambda app: gw.start())
    app.on_cleanup.append(lambda app: gw.close())
    return app


def _json_error(gw: Handler, err: GpuhitError, path: str) -> web.Response:
    status, data = gw.error_payload(err, path if path in PROMPT_PATHS else "other")
    return web.Response(body=data, status=status, content_type="application/json")


def _guard(gw: Handler):
    """The API key checked on the headers before a handler reads any body, and aiohttp's routing
    errors (404, 405) answered with vLLM's JSON error body."""

    @web.middleware
    async def guard(request: web.Request, handler) -> web.StreamResponse:
        denied = gw.auth_error(request.headers, request.path)
        if denied is not None:
            resp = _json_error(gw, denied, request.path)
            if request.body_exists:
                resp.force_close()  # the body is not read: its bytes cannot frame a next request
            return resp
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed:
            return _json_error(gw, MethodNotAllowedError(f"method {request.method} is not allowed on {request.path}"),
                               request.path)
        except web.HTTPNotFound:
            return _json_error(gw, NotFoundError(f"no such endpoint: {request.path}"), request.path)

    return guard


class _JsonErrorHandler(RequestHandler):
    """aiohttp's connection handler with its protocol-level errors (malformed request, line or
    field too long, too many headers) answered with vLLM's JSON error body, not plain text."""

    gw: Handler

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs; raises if a response already began
        err = BadRequestError(message or str(exc) or "malformed HTTP request")
        err.http_status = status  # type: ignore[misc]
        err.error_type = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else None  # type: ignore[attr-defined]
        code, data = self.gw.error_payload(err, "other")
        out = web.Response(body=data, status=code, content_type="application/json")
        out.force_close()
        return out


class _Runner(web.AppRunner):
    def __init__(self, gw: Handler, **kwargs):
        super().__init__(gw.app, **kwargs)
        self._handler_cls = type("GatewayRequestHandler", (_JsonErrorHandler,), {"gw": gw})

    async def _make_server(self) -> Server:
        srv = await super()._make_server()
        handler_cls = self._handler_cls

        class _Server(Server):
            def __call__(self) -> RequestHandler:
                return handler_cls(self, loop=self._loop, **self._kwargs)

        # Same handler, factory and settings; only the per-connection handler class differs.
        return _Server(srv.request_handler, request_factory=srv.request_factory, loop=srv._loop, **srv._kwargs)


def runner(gw: Handler) -> web.AppRunner:
    """The aiohttp runner of ``gw.app``: h11-like limits (8 KiB line and field, 100 headers), the
    keep-alive timeout, JSON error bodies. aiohttp has no header-read timeout and no connection
    bound (see the README's transport comparison)."""
    from gateway.http.fast import MAX_HEADERS, MAX_LINE

    return _Runner(gw, access_log=None, keepalive_timeout=gw.cfg.keepalive_timeout, max_line_size=MAX_LINE,
                   max_field_size=MAX_LINE, max_headers=MAX_HEADERS)
