"""What the two transports (:mod:`gateway.http.aio`, :mod:`gateway.http.fast`) call on the gateway.

:class:`gateway.http.app.Gateway` builds a transport and hands itself over; the transport sees only
this surface, so neither transport imports the module that builds it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from aiohttp import web

from gateway.config import GatewayConfig
from gateway.http.passthrough import Passthrough
from gateway.http.replies import Replies
from gateway.http.transport import Downstream
from gpuhit.errors import GpuhitError, PayloadTooLargeError, UnauthorizedError


class Handler(Protocol):
    """The gateway's request logic as a transport serves it: the prompt routes (``handle``), the
    GET and admin routes, every other route (``passthrough``), the refusals a transport answers
    itself (auth, body size, malformed HTTP) and the lifecycle the aiohttp application drives."""

    cfg: GatewayConfig
    replies: Replies
    passthrough: Passthrough | None  # built by start()
    # A prompt route's request (endpoint, headers, body) answered on ``down``; swapped by start().
    handle: Callable[[str, Mapping[str, str], bytes, Downstream], Awaitable[None]]

    @property
    def app(self) -> web.Application: ...

    def get(self, path: str) -> tuple[int, str, bytes] | None: ...

    async def reset_prefix_cache(self) -> tuple[int, str, bytes]: ...

    def error_payload(self, exc: GpuhitError, endpoint: str) -> tuple[int, bytes]: ...

    def auth_error(self, headers: Mapping[str, str], path: str) -> UnauthorizedError | None: ...

    def body_limit_error(self, size: int | None) -> PayloadTooLargeError: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
