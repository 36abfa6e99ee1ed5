"""The emulated server's Anthropic Messages and OpenAI Responses routes, in vLLM 0.32's shapes.

vLLM serves both by converting the request to a chat request (:mod:`engines.vllm.dialects`) and
reshaping the chat answer; the emulator does the same over its chat tokenization and engine:

* ``POST /v1/messages`` (and ``/v1/messages/count_tokens``): an Anthropic message; streamed as
  ``message_start``, one ``content_block_delta`` per token inside a text block, ``message_delta``
  with the usage, ``message_stop``. Usage as vLLM's: ``input_tokens`` = prompt - cached - newly
  cached, ``cache_read_input_tokens`` = the prefix hit, ``cache_creation_input_tokens`` = the
  full blocks this request added to the cache. Errors in Anthropic's ``{"type": "error", ...}``.
* ``POST /v1/responses``: a Responses object (status ``incomplete``, reason ``max_output_tokens``:
  the emulator has no EOS), ``usage.input_tokens_details.cached_tokens`` = the prefix hit; streamed
  as vLLM's ``response.created`` ... ``response.completed`` events. ``store`` (vLLM's default true)
  keeps the response and its messages in this server's memory (bounded): ``previous_response_id``
  continues from them, ``GET /v1/responses/{id}`` returns it, ``POST .../{id}/cancel`` answers as
  vLLM does for a finished synchronous response; an unknown id is vLLM's 404.

Tools are rendered into the prompt as the chat route renders messages; the emulator never calls a
tool (its output is ``" x"`` per token), as a model free to choose may not. A ``tool_choice`` that
forces a call is refused with a 400 rather than silently not honoured.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from engines.base import GenerateRequest, GenerateResult
from engines.emulated.responses import cached_tokens
from engines.emulated.token_stream import Progress, relay_tokens
from engines.vllm import protocol
from engines.vllm.chat_messages import NotExact
from engines.vllm.dialects import anthropic, responses
from gpuhit.errors import BadRequestError, GpuhitError, NotFoundError

STORE_MAX = 4096  # stored responses kept per server (oldest dropped first)


class DialectRoutes:
    """Messages and Responses routes over one :class:`~engines.emulated.server.EmulatedServer`
    (``server``), which hands over what it shares with its chat route: the text of a generated
    token and its chat tokenization (``chat_ids``)."""

    def __init__(self, server: Any, token_text: str, chat_ids: Any):
        self.server = server
        self.token_text = token_text
        self._chat_ids = chat_ids
        self.stored: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def mount(self, app: web.Application) -> None:
        app.add_routes([
            web.post("/v1/messages", self.messages),
            web.post("/v1/messages/count_tokens", self.count_tokens),
            web.post("/v1/responses", self.responses),
            web.get("/v1/responses/{response_id}", self.get_response),
            web.post("/v1/responses/{response_id}/cancel", self.cancel_response),
        ])

    # ------------------------------------------------------------------------------- common

    def _ids(self, chat: Mapping[str, Any]) -> list[int]:
        messages = chat["messages"]
        if not messages:
            raise protocol.bad_request("Cannot apply chat template to an empty conversation.")
        return self._chat_ids(messages)

    async def _body(self, request: web.Request) -> Mapping[str, Any]:
        body = protocol.parse_body(await request.read(), self.server.model, f" Valid aliases: {self.server.model}.")
        if isinstance(body.get("tool_choice"), Mapping) and body["tool_choice"].get("type") in ("any", "tool", "function"):
            raise protocol.bad_request("the emulated engine cannot force a tool call (it never calls tools)",
                                       "tool_choice")
        if body.get("tool_choice") == "required":
            raise protocol.bad_request("the emulated engine cannot force a tool call (it never calls tools)",
                                       "tool_choice")
        return body

    def _request(self, request: web.Request, prefix: str, ids: list[int], requested: int | None) -> GenerateRequest:
        s = self.server
        max_tokens = s._max_tokens(len(ids), requested, chat=True)
        s._check_capacity(len(ids), max_tokens)
        session = request.headers.get("x-session-id")
        return GenerateRequest(request_id=f"{prefix}{request.headers.get('x-request-id') or uuid.uuid4().hex[:16]}",
                               prompt_len=len(ids), max_tokens=max_tokens, prompt_token_ids=ids,
                               block_hashes=tuple(s._hashes.hashes(ids, session)), session_id=session)

    def _created(self, res: GenerateResult) -> int:
        """Full blocks this request added to the cache (vLLM's ``created_cache_tokens``)."""
        bs = self.server.block_size
        return max(res.prompt_tokens // bs * bs - cached_tokens(res), 0)

    async def _generate(self, greq: GenerateRequest, on_token: Any = None) -> GenerateResult:
        """Run ``greq``; ``on_token(k)`` is awaited for each output token as it is produced."""
        if on_token is None:
            return await self.server._run(greq, None)
        progress = Progress()
        task = asyncio.ensure_future(self.server._run(greq, progress))
        try:
            sent = await relay_tokens(task, progress, on_token)
            res = task.result()
            for k in range(sent, res.completion_tokens):
                await on_token(k)
            return res
        finally:
            if not task.done():
                task.cancel()

    @staticmethod
    async def _sse(resp: web.StreamResponse, event: str, data: Mapping[str, Any]) -> None:
        await resp.write(f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode())

    # ------------------------------------------------------------------------------ Messages

    @staticmethod
    def _anthropic_error(exc: GpuhitError) -> web.Response:
        status, body = protocol.error_from_exc(exc)
        err = body.get("error", {})
        kind = "NotFoundError" if status == 404 else err.get("type", "BadRequestError")
        return web.json_response({"type": "error", "error": {"type": kind, "message": err.get("message", str(exc))}},
                                 status=status)

    def _messages_ids(self, body: Mapping[str, Any]) -> list[int]:
        try:
            return self._ids(anthropic.to_chat(body))
        except NotExact as exc:
            raise BadRequestError(f"the emulated engine does not serve {exc}") from None

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            n = len(self._messages_ids(await self._body(request)))
        except GpuhitError as exc:
            return self._anthropic_error(exc)
        return web.json_response({"input_tokens": n, "context_management": {"original_input_tokens": n}})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            if not isinstance(body.get("max_tokens"), int):
                raise protocol.validation_error("max_tokens", "Field required", body.get("max_tokens"))
            greq = self._request(request, "chatcmpl-", self._messages_ids(body), body["max_tokens"])
        except GpuhitError as exc:
            return self._anthropic_error(exc)
        msg = {"id": greq.request_id, "type": "message", "role": "assistant", "content": [], "model": self.server.model}
        if not body.get("stream"):
            res = await self.server._run(greq, None)
            if res.error is not None:
                return self._anthropic_error(GpuhitError(res.error))
            msg["content"] = [{"type": "text", "text": self.token_text * res.completion_tokens}]
            return web.json_response({**msg, "stop_reason": "max_tokens", "usage": self._anthropic_usage(res)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await self._sse(resp, "message_start", {"type": "message_start", "message": {
            **msg, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": greq.prompt_len, "output_tokens": 0}}})

        async def token(k: int) -> None:
            if k == 0:
                await self._sse(resp, "content_block_start", {"type": "content_block_start",
                                                              "content_block": {"type": "text", "text": ""}, "index": 0})
            await self._sse(resp, "content_block_delta", {"type": "content_block_delta",
                                                          "delta": {"type": "text_delta", "text": self.token_text},
                                                          "index": 0})

        res = await self._generate(greq, token)
        if res.error is not None:
            await self._sse(resp, "error", {"type": "error", "error": {"type": "internal_error", "message": res.error}})
        else:
            if res.completion_tokens:
                await self._sse(resp, "content_block_stop", {"type": "content_block_stop", "index": 0})
            await self._sse(resp, "message_delta", {"type": "message_delta",
                                                    "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                                    "usage": self._anthropic_usage(res)})
            await self._sse(resp, "message_stop", {"type": "message_stop"})
        await resp.write_eof()
        return resp

    def _anthropic_usage(self, res: GenerateResult) -> dict[str, int]:
        cached, created = cached_tokens(res), self._created(res)
        return {"input_tokens": max(res.prompt_tokens - cached - created, 0), "output_tokens": res.completion_tokens,
                "cache_creation_input_tokens": created, "cache_read_input_tokens": cached}

    # ----------------------------------------------------------------------------- Responses

    async def responses(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            prev_id = body.get("previous_response_id")
            previous = None
            if prev_id is not None:
                if prev_id not in self.stored:
                    raise self._not_found(prev_id)
                previous = [m for m in self.stored[prev_id][1] if m.get("role") != "system"]
                previous += responses.output_messages(self.stored[prev_id][0])
            try:
                chat = responses.to_chat(body, previous)
            except NotExact as exc:
                raise BadRequestError(f"the emulated engine does not serve {exc}") from None
            mot = body.get("max_output_tokens")
            if mot is not None and (not isinstance(mot, int) or isinstance(mot, bool)):
                raise protocol.validation_error("max_output_tokens", "Input should be a valid integer", mot)
            greq = self._request(request, "resp_", self._ids(chat), mot)
        except GpuhitError as exc:
            return self.server._error(exc)
        created = int(self.server._now())
        store = body.get("store", True) is not False
        if not body.get("stream"):
            res = await self.server._run(greq, None)
            if res.error is not None:
                return self.server._error(GpuhitError(res.error))
            out = self._response(greq, body, created, res)
            if store:
                self._store(out, chat["messages"])
            return web.json_response(out)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        seq = iter(range(1 << 62))
        start = self._response(greq, body, created, None)
        for kind in ("response.created", "response.in_progress"):
            await self._sse(resp, kind, {"response": start, "sequence_number": next(seq), "type": kind})
        item = f"msg_{uuid.uuid4().hex[:16]}"

        async def token(k: int) -> None:
            if k == 0:
                await self._sse(resp, "response.output_item.added", {
                    "item": {"id": item, "content": [], "role": "assistant", "status": "in_progress",
                             "type": "message", "phase": None},
                    "output_index": 0, "sequence_number": next(seq), "type": "response.output_item.added"})
                await self._sse(resp, "response.content_part.added", {
                    "content_index": 0, "item_id": item, "output_index": 0,
                    "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []},
                    "sequence_number": next(seq), "type": "response.content_part.added"})
            await self._sse(resp, "response.output_text.delta", {
                "content_index": 0, "delta": self.token_text, "item_id": item, "logprobs": [], "output_index": 0,
                "sequence_number": next(seq), "type": "response.output_text.delta"})

        res = await self._generate(greq, token)
        if res.error is not None:
            await self._sse(resp, "error", {"type": "error", "code": "internal_error", "message": res.error,
                                            "param": None, "sequence_number": next(seq)})
        else:
            out = self._response(greq, body, created, res, item)
            if res.completion_tokens:
                text = self.token_text * res.completion_tokens
                part = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
                await self._sse(resp, "response.output_text.done", {
                    "content_index": 0, "item_id": item, "logprobs": [], "output_index": 0,
                    "sequence_number": next(seq), "text": text, "type": "response.output_text.done"})
                await self._sse(resp, "response.content_part.done", {
                    "content_index": 0, "item_id": item, "output_index": 0, "part": part,
                    "sequence_number": next(seq), "type": "response.content_part.done"})
                await self._sse(resp, "response.output_item.done", {
                    "item": out["output"][0], "output_index": 0, "sequence_number": next(seq),
                    "type": "response.output_item.done"})
            await self._sse(resp, "response.completed", {"response": out, "sequence_number": next(seq),
                                                         "type": "response.completed"})
            if store:
                self._store(out, chat["messages"])
        await resp.write_eof()
        return resp

    def _response(self, greq: GenerateRequest, body: Mapping[str, Any], created: int, res: GenerateResult | None,
                  item: str | None = None) -> dict[str, Any]:
        """vLLM's ``ResponsesResponse`` (its keys, in its order); ``res`` None: the in-progress one."""
        output: list[dict[str, Any]] = []
        usage = None
        if res is not None:
            if res.completion_tokens:
                output.append({"id": item or f"msg_{uuid.uuid4().hex[:16]}", "content": [
                    {"annotations": [], "text": self.token_text * res.completion_tokens, "type": "output_text",
                     "logprobs": None}], "role": "assistant", "status": "completed", "type": "message", "phase": None})
            cached = cached_tokens(res)
            usage = {"input_tokens": res.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": self._created(res),
                                              "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                     "output_tokens": res.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                               "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                     "total_tokens": res.prompt_tokens + res.completion_tokens}
        return {
            "id": greq.request_id, "created_at": created,
            "incomplete_details": {"reason": "max_output_tokens"} if res is not None else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": self.server.model,
            "object": "response", "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "tool_choice": body.get("tool_choice", "auto")
            if body.get("tools") else "none", "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0),
            "background": False, "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": None,
            "previous_response_id": body.get("previous_response_id"), "prompt": None,
            "reasoning": body.get("reasoning"), "service_tier": "auto",
            "status": "incomplete" if res is not None else "in_progress", "text": None, "top_logprobs": None,
            "truncation": "disabled", "usage": usage, "user": None, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "kv_transfer_params": None, "ec_transfer_params": None,
            "input_messages": None, "output_messages": None,
        }

    def _store(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.stored[response["id"]] = (response, messages)
        while len(self.stored) > STORE_MAX:
            self.stored.popitem(last=False)

    @staticmethod
    def _not_found(response_id: str) -> NotFoundError:
        err = NotFoundError(f"Response with id '{response_id}' not found.")
        err.param = "response_id"  # type: ignore[attr-defined]
        err.error_type = "invalid_request_error"  # type: ignore[attr-defined]
        return err

    async def get_response(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        if rid not in self.stored:
            return self.server._error(self._not_found(rid))
        return web.json_response(self.stored[rid][0])

    async def cancel_response(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        if rid not in self.stored:
            return self.server._error(self._not_found(rid))
        err = protocol.bad_request("Cannot cancel a synchronous response.", "response_id")
        err.error_type = "invalid_request_error"  # type: ignore[attr-defined]
        return self.server._error(err)
