"""What the gateway answers a client itself: errors in vLLM's JSON shape (or as an SSE error event
once a stream has started), and the refusals decided on a request's head (API key, body size).

Every answer of this kind is counted once, here, in ``gpuhit_gateway_requests_total``."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from engines.vllm import protocol
from gateway.http.transport import Downstream, needs_auth
from gateway.metrics import GatewayMetrics
from gpuhit.errors import GpuhitError, PayloadTooLargeError, UnauthorizedError


class Replies:
    """Error answers, counted in ``metrics`` by endpoint and status."""

    def __init__(self, metrics: GatewayMetrics):
        self.metrics = metrics
        # Endpoints whose API has its own error shape (Anthropic's for /v1/messages), as vLLM answers
        # there: endpoint -> (message, status, error type) -> body. Others: vLLM's OpenAI shape.
        self.error_bodies: dict[str, Callable[[str, int, str | None], dict[str, Any]]] = {}

    def payload(self, exc: GpuhitError, endpoint: str) -> tuple[int, bytes]:
        """(status, JSON body) of an error answer in the endpoint's API's shape (vLLM's); counted."""
        status = int(exc.http_status)
        shape = self.error_bodies.get(endpoint)
        if shape is not None:
            body = shape(str(exc), status, getattr(exc, "error_type", None))
        else:
            body = protocol.error_body(str(exc), status, getattr(exc, "param", None),
                                       getattr(exc, "error_type", None))
        self.metrics.requests.inc((endpoint, str(status)))
        return status, orjson.dumps(body)

    async def send(self, down: Downstream, exc: GpuhitError, endpoint: str,
                   headers: Mapping[str, str] | None = None) -> None:
        """A JSON error answer (the stream has not started)."""
        status, data = self.payload(exc, endpoint)
        await down.respond(status, headers or {}, data, "application/json")

    async def fail(self, down: Downstream, exc: GpuhitError, endpoint: str, headers: Mapping[str, str]) -> None:
        """An error after routing: a JSON error answer, or an SSE error event and ``[DONE]`` once the
        stream's head went out (the client's status line can no longer change)."""
        if not down.started:
            return await self.send(down, exc, endpoint, headers)
        status, body = protocol.error_from_exc(exc)
        self.metrics.requests.inc((endpoint, str(status)))
        shape = self.error_bodies.get(endpoint)
        try:
            if shape is not None:  # Anthropic's stream: an `error` event, no [DONE]
                data = orjson.dumps(shape(str(exc), status, getattr(exc, "error_type", None)))
                await down.write(b"event: error\ndata: %b\n\n" % data)
            else:
                await down.write(protocol.sse(body))
                await down.write(protocol.SSE_DONE)
            await down.end()
        except ConnectionError:
            pass


class Access:
    """Refusals decided on a request's head, before its body is read: the API key (compared in
    constant time) and the body size limit."""

    def __init__(self, api_key: str | None, metrics_auth: bool, max_body_bytes: int):
        self._key = None if api_key is None else f"Bearer {api_key}".encode("latin-1", "replace")
        self.open = api_key is None  # no API key is configured: every request is let in (read per request)
        self.metrics_auth = metrics_auth
        self.max_body_bytes = max_body_bytes

    def denied(self, headers: Mapping[str, str], path: str) -> UnauthorizedError | None:
        """The 401 for a request to ``path`` that needs the API key and lacks it, else None."""
        key = self._key
        if key is None or not needs_auth(path, self.metrics_auth):
            return None
        got = headers.get("authorization")
        if got is not None and hmac.compare_digest(got.encode("latin-1", "replace"), key):
            return None
        return UnauthorizedError("missing or wrong API key (send 'Authorization: Bearer <key>')")

    def too_large(self, size: int | None) -> PayloadTooLargeError:
        """The 413 of a body over the limit (``size``: its declared length, when known)."""
        limit = self.max_body_bytes
        if size is None:
            return PayloadTooLargeError(f"request body exceeds the {limit}-byte limit")
        return PayloadTooLargeError(f"request body of {size} bytes exceeds the {limit}-byte limit")
