"""The ``fast`` transport's answers to everything but a routed POST: a refused request's error,
the gateway's own GET routes and prefix-cache reset, a wrong method on a known path (405), and
any other route forwarded to an engine (:mod:`gateway.http.passthrough`). A routed POST goes from
the connection (:mod:`gateway.http.fast`) straight to the gateway's request pipeline."""

from __future__ import annotations

from gateway.http.fast_response import ServerRequest
from gateway.http.handler import Handler
from gateway.http.parse import PROMPT_PATHS
from gateway.http.transport import GET_PATHS, RESET_PREFIX_CACHE, MethodNotAllowedError
from gpuhit.errors import GpuhitError


async def dispatch(gw: Handler, req: ServerRequest) -> None:
    """Answer ``req`` (not a routed POST) for gateway ``gw``."""
    method = req.method
    path = req.path
    if req.reject is not None:
        status, data = gw.error_payload(req.reject, path if path in PROMPT_PATHS else "other")
        return await req.respond(status, {}, data, "application/json")
    if method == b"POST" and path == RESET_PREFIX_CACHE:
        status, ctype, data = await gw.reset_prefix_cache()
        return await req.respond(status, {}, data, ctype)
    if method in (b"GET", b"HEAD") and (out := gw.get(path)) is not None:
        status, ctype, data = out
        await req.respond(status, {}, data, ctype)
        return
    if path in PROMPT_PATHS or path in GET_PATHS or path == RESET_PREFIX_CACHE:
        err: GpuhitError = MethodNotAllowedError(f"method {method.decode('latin-1')} is not allowed on {path}")
        status, data = gw.error_payload(err, path if path in PROMPT_PATHS else "other")
        return await req.respond(status, {}, data, "application/json")
    # Any other route: forwarded to an engine.
    assert gw.passthrough is not None
    await gw.passthrough.handle(method.decode("latin-1"), path, req.query, req.headers, req.body, req)
