"""The agentic prompt dialects: Anthropic Messages (``/v1/messages``) and OpenAI Responses
(``/v1/responses``), routed by the policy as chat is, with exact predicted hits.

Each request is rendered to the token ids vLLM runs for it (:class:`gateway.dialects.render.DialectRenderer`:
the dialect converted to vLLM's chat request, then the engines' chat template and tokenizer);
what cannot be rendered exactly is routed by the approximate hash of its text and counted, as for
chat. The session comes from the dialect (:mod:`gateway.dialects.sessions`) when no
``x-session-id`` header names one.

Responses are stateful in vLLM: a stored response lives in the memory of the engine that answered
it. The gateway names every Responses request it forwards (vLLM's ``request_id`` field, which
becomes the response id, unless the client set one) and, once the answer is relayed, records which
engine holds it and what a request continuing it renders (:class:`gateway.dialects.history.ResponseHistory`).
A request naming a previous response is pinned to that engine (routing still predicts its hit);
when that engine is unhealthy or the id unknown, the client gets vLLM's 404 shape with the reason.

The answers report usage in their own fields: Messages ``cache_read_input_tokens`` (and
``input_tokens`` net of cached and newly cached tokens), Responses
``input_tokens_details.cached_tokens``; streams end with ``message_stop`` / ``response.completed``
instead of ``[DONE]``. Errors of ``/v1/messages`` are in Anthropic's shape.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from engines.vllm import protocol
from gateway.dialects import sessions
from gateway.dialects.history import ResponseHistory
from gateway.dialects.render import DialectRenderer
from gateway.http.forward import forwarded_body
from gateway.http.parse import ErrorBody, ParsedRequest, Prompts
from gateway.http.prompt import chat_text
from gateway.http.transport import MESSAGES, RESPONSES
from gateway.http.usage import Usage, usage_from_tail
from gpuhit.errors import BadRequestError

_bad = protocol.bad_request


def anthropic_error_body(message: str, status: int, error_type: str | None = None) -> dict[str, Any]:
    """vLLM's Anthropic error shape (``vllm/entrypoints/anthropic/api_router.py``)."""
    kind = error_type or protocol.error_body(message, status)["error"]["type"]
    return {"type": "error", "error": {"type": kind, "message": message}}


class _Agentic:
    """What both dialects share: the renderer over the engines' tokenizer, the response history."""

    path = ""
    stream_end = b""
    error_body: ErrorBody | None = None  # vLLM's OpenAI error shape

    def __init__(self, prompts: Prompts, history: ResponseHistory | None = None, names: Sequence[str] = ()):
        self.prompts = prompts
        self.renderer = None if prompts.tokenizer is None else DialectRenderer(prompts.tokenizer)
        self.history = history if history is not None else ResponseHistory()
        self.names = list(names)

    def stream_complete(self, tail: bytes) -> bool:
        return self.stream_end in tail[-256:]

    def answered(self, req: ParsedRequest, target: int, data: bytes, streamed: bool) -> None:
        """A 200 answer of ``req`` relayed from engine ``target`` (``data``: the whole answer, or
        a stream's tail)."""


class Messages(_Agentic):
    """``POST /v1/messages``: Anthropic Messages, routed like chat."""

    path = MESSAGES
    stream_end = b"message_stop"

    def parse(self, raw: bytes, session: str | None) -> ParsedRequest:
        p = self.prompts
        body = p.body(raw)
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _bad("max_tokens must be a positive integer", "max_tokens")
        _, stream = p.options({"stream": body.get("stream", False)})
        if session is None:
            session = sessions.anthropic_session({}, body)
        r = self.renderer
        return p.rendered(self, body, raw, max_tokens, stream, session, "messages",
                          lambda: r.messages_ids(body, session),  # type: ignore[union-attr]  # with a tokenizer
                          lambda: _messages_text(body))

    @staticmethod
    def _usage(u: Any) -> Usage | None:
        if not isinstance(u, dict):
            return None
        return Usage(int(u.get("cache_read_input_tokens") or 0), int(u.get("output_tokens") or 0))

    def usage_of_answer(self, data: bytes) -> Usage | None:
        return self._usage(self.prompts.usage.of_json(data))

    def usage_of_stream(self, tail: bytes) -> Usage | None:
        return self._usage(usage_from_tail(tail))  # message_delta: the last event with a usage

    error_body = staticmethod(anthropic_error_body)  # Anthropic's shape, as vLLM answers there


class Responses(_Agentic):
    """``POST /v1/responses``: OpenAI Responses, routed like chat, stored responses pinned."""

    path = RESPONSES
    stream_end = b"response.completed"

    def parse(self, raw: bytes, session: str | None) -> ParsedRequest:
        p = self.prompts
        body = p.body(raw)
        mot = body.get("max_output_tokens")
        # Without max_output_tokens vLLM lets the answer fill the context (check_len clamps to it).
        max_tokens, stream = p.options({"max_output_tokens": p.max_model_len or 16 if mot is None else mot,
                                        "stream": body.get("stream", False)}, "max_output_tokens")
        h = self.history
        prev = body.get("previous_response_id")
        pin = None
        previous = None
        if prev is not None:
            if not isinstance(prev, str):
                raise _bad("previous_response_id must be a string", "previous_response_id")
            pin = h.holder(prev, self.names, "previous_response_id")
            previous = h.messages_after(prev)
        if session is None:
            session = sessions.responses_session({}, body, h.session_of)
        rid = body.get("request_id")
        if rid is None:
            # The response id the engine will use (vLLM's default form), known before the answer.
            rid = f"resp_{uuid.uuid4().hex}"
            raw = forwarded_body(raw, {"request_id": rid})
        elif not isinstance(rid, str):
            raise _bad("request_id must be a string", "request_id")
        chat: list[Any] = []
        r = self.renderer

        def render() -> list[int]:
            ids, conv = r.responses_ids(body, session, previous)  # type: ignore[union-attr]
            chat.append(conv["messages"])
            return ids

        req = p.rendered(self, body, raw, max_tokens, stream, session, "responses", render,
                         lambda: _responses_text(body), pin=pin)
        store = body.get("store", True) is not False
        req.state = (rid, chat[0] if chat else None, session) if store else None
        return req

    def usage_of_answer(self, data: bytes) -> Usage | None:
        return self._usage(self.prompts.usage.of_json(data))

    def usage_of_stream(self, tail: bytes) -> Usage | None:
        # response.completed carries the whole response: its "usage" object sits near its end,
        # found as in a JSON body (the event's start may lie before the tail).
        return self._usage(usage_from_tail(tail, sse=False))

    @staticmethod
    def _usage(u: Any) -> Usage | None:
        if not isinstance(u, dict):
            return None
        details = u.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Usage(int(cached or 0), int(u.get("output_tokens") or 0))

    def answered(self, req: ParsedRequest, target: int, data: bytes, streamed: bool) -> None:
        state = req.state
        if state is None:
            return
        rid, messages, session = state
        response = _completed_response(data) if streamed else _json(data)
        if isinstance(response, dict) and isinstance(response.get("id"), str):
            rid = response["id"]
        elif streamed:
            response = None  # the final event did not fit the tail: the next turn is rendered approximately
        self.history.record(rid, self.names[target], messages if response is not None else None, response, session)


def _json(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _completed_response(tail: bytes) -> Any:
    """The response of a stream's ``response.completed`` event, when the whole event is in ``tail``."""
    at = tail.rfind(b"event: response.completed")
    if at < 0:
        return None
    start = tail.find(b"data:", at)
    doc = _json(tail[start + 5:]) if start >= 0 else None
    return doc.get("response") if isinstance(doc, dict) else None


def _messages_text(body: Mapping[str, Any]) -> str:
    """A Messages request flattened for the approximate hash."""
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system if isinstance(b, Mapping))
    msgs = [{"role": m.get("role"), "content": _blocks_text(m.get("content"))} for m in body.get("messages") or []
            if isinstance(m, Mapping)]
    return f"system\n{system or ''}\n" + chat_text(msgs)


def _blocks_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequestError("message content must be a string or a list of content blocks")
    out = []
    for b in content:
        if isinstance(b, Mapping):
            v = b.get("text") or b.get("thinking") or b.get("content") or b.get("input") or ""
            out.append(v if isinstance(v, str) else orjson.dumps(v).decode())
    return "\n".join(out)


def _responses_text(body: Mapping[str, Any]) -> str:
    inp = body.get("input")
    items = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp if isinstance(inp, list) else []
    msgs = [{"role": i.get("role") or i.get("type"), "content": _blocks_text(i.get("content") or i.get("output")
                                                                             or i.get("arguments") or "")}
            for i in items if isinstance(i, Mapping)]
    return f"system\n{body.get('instructions') or ''}\n" + chat_text(msgs)
