"""OpenAI Responses requests (``/v1/responses``) as the chat request vLLM renders for them.

vLLM (0.32, ``vllm/entrypoints/openai/responses/utils.py`` ``construct_input_messages`` and
``construct_tool_dicts``, non-Harmony models) builds chat messages from a Responses request:

* ``instructions`` (when non-empty) is the first, system, message;
* a ``previous_response_id`` brings that response's stored messages (without their system
  messages: instructions do not carry over), then one assistant message per text content of each
  ``message`` item of its output (reasoning and function calls of that output are not carried);
* a string ``input`` is one user message; a list of items becomes: ``function_call`` (and
  ``custom_tool_call``, its input wrapped as ``{"input": ...}``) -> an assistant ``tool_calls``
  entry, joined to the assistant message just before it; ``reasoning`` (content, else summary
  text) -> ``reasoning`` of that message or a new one; assistant ``message`` items -> their first
  content's text, likewise joined; ``function_call_output`` -> a ``tool`` message; any other item
  with a ``role`` is passed as a chat message (``input_text`` parts are text parts);
* function tools (namespace members flattened to ``namespace__name``, custom tools as a one-string
  function) become chat-completions tools; ``reasoning.effort`` is the template's
  ``reasoning_effort``.

Encrypted reasoning, partial (``in_progress``) final items and media parts raise
:class:`engines.vllm.chat_messages.NotExact`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from engines.vllm.chat_messages import NotExact
from engines.vllm.dialects.shapes import bad, check_str

CUSTOM_TOOL_INPUT_KEY = "input"
_CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_TOOL_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": [CUSTOM_TOOL_INPUT_KEY],
    "additionalProperties": False,
}


def to_chat(body: Mapping[str, Any], previous: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The chat-completions body vLLM renders for Responses ``body``; ``previous``: the messages
    the named previous response leaves (the gateway's :class:`gateway.dialects.history.ResponseHistory`)."""
    if body.get("previous_response_id") is not None and previous is None:
        raise NotExact("a previous response the gateway did not see answered")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": check_str(instructions, "instructions")})
    if previous is not None:
        messages.extend(dict(m) for m in previous)
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        if inp and isinstance(inp[-1], Mapping) and inp[-1].get("type", "message") in ("message", "reasoning") \
                and inp[-1].get("status") in ("in_progress", "incomplete"):
            raise NotExact("a partial final item (continue_final_message)")
        own: list[dict[str, Any]] = []
        for item in inp:
            m = _item(item, own[-1] if own else None)
            if m is not None:
                own.append(m)
        messages.extend(own)
    else:
        raise bad("input must be a string or a list of items", "input")
    chat: dict[str, Any] = {"messages": messages}
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise bad("tools must be a list", "tools")
        chat["tools"] = [_chat_tool(t) for t in _function_tools(tools)]
    return chat


def _item(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item as a new chat message, or None when it joined ``prev`` (vLLM's
    ``_construct_message_from_response_item``)."""
    if not isinstance(item, Mapping):
        raise bad("input items must be objects", "input")
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    call = None
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            check_str(item.get(key), f"input.{key}")
        name = item["name"] if not item.get("namespace") else f"{item['namespace']}__{item['name']}"
        call = {"id": item["call_id"], "function": {"name": name, "arguments": item["arguments"]}, "type": "function"}
    elif kind == "custom_tool_call":
        payload = json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
        call = {"id": item.get("call_id"), "function": {"name": item.get("name"), "arguments": payload}, "type": "function"}
    if call is not None:
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise NotExact("encrypted reasoning content")
        content, summary = item.get("content"), item.get("summary")
        if not isinstance(summary, list):
            raise bad("a reasoning item needs a summary list", "input")
        text = content[0].get("text") if content else summary[0].get("text") if summary else ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else _first_text(content) if isinstance(content, list) and content else None
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return {k: v for k, v in item.items()}
    raise bad(f"Unsupported input item type: {kind}", "input")


def _first_text(content: list[Any]) -> str | None:
    first = content[0]
    if not isinstance(first, Mapping):
        raise bad("assistant message content items must be objects", "input")
    if first.get("type") == "refusal":
        raise NotExact("an assistant message starting with a refusal")
    return first.get("text")


def _function_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The function tools the model is shown, in request order (vLLM's ``get_function_tools``)."""
    out = []
    for t in tools:
        if not isinstance(t, Mapping):
            raise bad("each tool must be an object", "tools")
        kind = t.get("type")
        if kind == "namespace":
            out += [{**f, "name": f"{t.get('name')}__{f.get('name')}"} for f in t.get("tools") or []
                    if isinstance(f, Mapping) and f.get("type") == "function"]
        elif kind == "custom":
            out.append({"type": "function", "name": t.get("name"), "description": t.get("description"),
                        "parameters": _CUSTOM_TOOL_PARAMETERS})
        elif kind == "function":
            out.append(dict(t))
    return out


def _chat_tool(t: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(t.get("name"), str):
        raise bad("a function tool needs a name", "tools")
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                             "parameters": t.get("parameters"), "strict": t.get("strict"),
                                             "defer_loading": t.get("defer_loading")}}


def output_messages(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The assistant messages a stored response adds for a request that names it: one per text
    content of each output ``message`` item."""
    out = []
    for item in response.get("output") or []:
        if isinstance(item, Mapping) and item.get("type") == "message":
            for c in item.get("content") or []:
                if isinstance(c, Mapping) and isinstance(c.get("text"), str):
                    out.append({"role": "assistant", "content": c["text"]})
    return out
