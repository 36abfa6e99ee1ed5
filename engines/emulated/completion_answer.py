"""The emulated server's answer to a completions or chat request, in vLLM 0.32's shapes: the
whole body at once, or the SSE stream with one chunk per token sent at its own decode step's time.

Kept apart from :mod:`engines.emulated.server`, which parses and checks the request: this is how
the engine's result (or its failure) reaches the client. The bodies themselves are built by
:mod:`engines.emulated.responses`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from engines.base import GenerateRequest, GenerateResult
from engines.emulated.responses import SYSTEM_FINGERPRINT, chunk, completion_body, returned_params, usage
from engines.emulated.token_stream import Progress, relay_tokens
from engines.vllm import protocol
from gpuhit.errors import GpuhitError

#: the server's engine call: ``run(request, progress)`` (progress None: no per-token reports)
Run = Callable[[GenerateRequest, Progress | None], Awaitable[GenerateResult]]


def error_response(exc: GpuhitError) -> web.Response:
    """``exc`` as vLLM's JSON error, with its status."""
    status, body = protocol.error_from_exc(exc)
    return web.json_response(body, status=status)


def _finish_span(span: Any, res: GenerateResult) -> None:
    if span is None:
        return
    from gpuhit.tracing import finish_engine_span

    finish_engine_span(span, res)


async def unary_answer(run: Run, greq: GenerateRequest, head: dict[str, Any], chat: bool, span: Any) -> web.Response:
    """The whole answer at once (``head``: the id, object, created and model fields)."""
    try:
        res = await run(greq, None)
    except GpuhitError as exc:
        return error_response(exc)
    _finish_span(span, res)
    if res.error is not None:
        return web.json_response(protocol.error_body(res.error, 500), status=500)
    return web.json_response(completion_body(head, res, chat))


async def stream_answer(request: web.Request, run: Run, greq: GenerateRequest, head: dict[str, Any], chat: bool,
                        include_usage: bool, span: Any) -> web.StreamResponse:
    """The answer as vLLM's SSE stream: the role chunk (chat), one chunk per token at its step's
    time, the usage chunk when asked, ``[DONE]``; an engine failure as an error event."""
    progress = Progress()
    task = asyncio.ensure_future(run(greq, progress))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})

    async def token(k: int) -> None:
        await resp.write(chunk(head, chat, None))

    try:
        await resp.prepare(request)
        if chat:
            await resp.write(chunk(head, chat, None, role=True))
        # One chunk per token, the final one held back for its finish_reason. The engine
        # reports each decode step at its own time, so tokens leave at their step times.
        sent = await relay_tokens(task, progress, token, greq.max_tokens - 1)
        try:
            res = task.result()
        except GpuhitError as exc:
            _, body = protocol.error_from_exc(exc)
            await resp.write(protocol.sse(body))
            await resp.write(protocol.SSE_DONE)
            return resp
        _finish_span(span, res)
        if res.error is not None:
            await resp.write(protocol.sse(protocol.error_body(res.error, 500)))
        else:
            for k in range(sent, res.completion_tokens):
                last = k == res.completion_tokens - 1
                await resp.write(chunk(head, chat, "length" if last else None,
                                       fingerprint=last and not include_usage))
            if include_usage:
                tail = {**head, "choices": [], "usage": usage(res, chat, unary=False),
                        "system_fingerprint": SYSTEM_FINGERPRINT}
                if res.kv_transfer_params:
                    tail["kv_transfer_params"] = returned_params(res)
                await resp.write(protocol.sse(tail))
        await resp.write(protocol.SSE_DONE)
        await resp.write_eof()
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        # The client went away: stop generating, as vLLM aborts a disconnected request.
        task.cancel()
        raise
    finally:
        if not task.done():
            task.cancel()


__all__ = ["Run", "error_response", "stream_answer", "unary_answer"]
