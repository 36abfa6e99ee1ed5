"""What the gateway's request logic needs from an HTTP implementation, and the aiohttp one.

The request logic (:class:`gateway.http.app.Gateway`: parse -> route -> producer step -> forward ->
stream -> finish accounting, errors, ejection, tracing) is written once against two small
interfaces, so the transport is the only thing that differs between ``--transport aiohttp`` and
the default ``fast`` one (:mod:`gateway.http.fast`):

* :class:`Downstream`: the client's side of one request (a full response, or a chunked SSE
  stream whose ``write`` raises ``ConnectionError`` once the client is gone).
* :class:`Upstream`: keep-alive POSTs to engine ``i``, answering an :class:`UpstreamResponse`
  whose body is read whole or chunk by chunk and which is ``release()``-d when done: back to the
  pool if it was read to the end, else the connection is closed, which is how an engine learns the
  client went away (vLLM aborts the request).

Transport failures become two :class:`~gpuhit.errors.EngineError` subclasses: the engine could
not be reached (connect) or the connection broke after the request was sent (closed).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Protocol

import aiohttp

from gpuhit.errors import BadRequestError, EngineError, GpuhitError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"  # Anthropic Messages (gateway.http.agentic)
RESPONSES = "/v1/responses"  # OpenAI Responses (gateway.http.agentic)
RESET_PREFIX_CACHE = "/reset_prefix_cache"  # admin: fans out to every engine (vLLM dev route)
GET_PATHS = ("/v1/models", "/health", "/ready", "/metrics", "/debug/state")
# Answered without the API key: load balancers' probes.
_OPEN = frozenset(("/health", "/ready"))


def needs_auth(path: str, metrics_auth: bool) -> bool:
    """Whether a request to ``path`` must carry the API key (when one is set): everything but the
    probes (/health, /ready), and /metrics only with ``metrics_auth``."""
    if path in _OPEN:
        return False
    return metrics_auth or path != "/metrics"


# HTTP-level refusals: ``error_type`` is the ``type`` of vLLM's error body (FastAPI's
# HTTPException handler names it after the status phrase).


class MethodNotAllowedError(GpuhitError):
    http_status = 405
    code = "method_not_allowed"
    error_type = "Method Not Allowed"


class RequestTimeoutError(BadRequestError):
    http_status = 408
    code = "request_timeout"
    error_type = "Request Timeout"


class UriTooLongError(BadRequestError):
    http_status = 414
    code = "uri_too_long"
    error_type = "URI Too Long"


class HeadersTooLargeError(BadRequestError):
    http_status = 431
    code = "request_header_fields_too_large"
    error_type = "Request Header Fields Too Large"


class ExpectationFailedError(BadRequestError):
    http_status = 417
    code = "expectation_failed"
    error_type = "Expectation Failed"


class OverloadedError(GpuhitError):
    http_status = 503
    code = "too_many_connections"
    error_type = "Service Unavailable"


class UpstreamConnectError(EngineError):
    """The engine could not be reached (refused, unroutable, DNS)."""


class UpstreamClosedError(EngineError):
    """The engine's connection broke after the request was sent (crash, reset, truncated body)."""


class HeaderLines(Mapping[str, str]):
    """Response headers already encoded as ``name: value\r\n`` lines (latin-1). The fast
    transport writes :attr:`lines` as they are; anything else reads them as a mapping (parsed on
    first use). Why: the gateway's per-request ``x-gpuhit-*`` headers are built once as bytes
    instead of as a dict that each answer's head re-encodes."""

    __slots__ = ("_map", "lines")

    def __init__(self, lines: bytes):
        self.lines = lines
        self._map: dict[str, str] | None = None

    def _mapping(self) -> dict[str, str]:
        if self._map is None:
            pairs = (line.split(": ", 1) for line in self.lines.decode("latin-1").split("\r\n") if line)
            self._map = {k: v for k, v in pairs}
        return self._map

    def __getitem__(self, key: str) -> str:
        return self._mapping()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def __bool__(self) -> bool:  # without parsing (a Mapping's truth would call __len__)
        return bool(self.lines)


def header_block(headers: Mapping[str, str]) -> bytes:
    """``name: value\r\n`` per header, latin-1 (anything else replaced), in one encode; the bytes
    of :class:`HeaderLines` as they are."""
    if type(headers) is HeaderLines:
        return headers.lines
    # A loop, not a list comprehension: the comprehension runs in a frame of its own, half the
    # cost of the one or two headers a routed request sends upstream.
    lines = ""
    for k, v in headers.items():
        lines += f"{k}: {v}\r\n"
    return lines.encode("latin-1", "replace")


def nodelay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on a TCP transport's socket (answers leave at once, not after Nagle's wait)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Downstream(Protocol):
    started: bool  # a streamed response's head went out: errors can only travel as SSE events now

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes, content_type: str) -> None: ...

    async def start_stream(self, headers: Mapping[str, str]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


class UpstreamResponse(Protocol):
    status: int
    content_type: str

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def release(self) -> None: ...


class Upstream(Protocol):
    async def post(self, i: int, path: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse: ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------------------------ aiohttp

_CLOSED = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionResetError)


# The gateway times upstream exchanges itself (TTFB, idle, --timeout: gateway.http.forward); the
# session's default 300 s total would cut a long generation.
_UNTIMED = aiohttp.ClientTimeout(total=None)


class AioUpstreamResponse:
    __slots__ = ("_resp", "content_type", "status")

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.content_type or "application/json"

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except _CLOSED as exc:
            raise UpstreamClosedError(f"connection lost: {exc or type(exc).__name__}") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except _CLOSED as exc:
            raise UpstreamClosedError(f"{exc or type(exc).__name__}") from None

    def release(self) -> None:
        # release() keeps the connection when the body was read to its end; close() drops it.
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            self._resp.close()


class AioUpstream:
    """Upstream over one shared aiohttp ``ClientSession`` (keep-alive pool; aiohttp sets
    TCP_NODELAY on every connection it makes)."""

    def __init__(self, session: aiohttp.ClientSession, base_urls: Sequence[str]):
        self.session = session
        self.base_urls = list(base_urls)

    async def post(self, i: int, path: str, body: bytes, headers: Mapping[str, str]) -> AioUpstreamResponse:
        url = self.base_urls[i] + path
        try:
            resp = await self.session.post(url, data=body, headers={"Content-Type": "application/json", **headers},
                                           timeout=_UNTIMED)
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamConnectError(f"{exc.os_error or exc}") from None
        except _CLOSED as exc:
            raise UpstreamClosedError(f"{exc or type(exc).__name__}") from None
        return AioUpstreamResponse(resp)

    async def close(self) -> None:
        pass  # the session belongs to the gateway
