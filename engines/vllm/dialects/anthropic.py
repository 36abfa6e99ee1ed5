"""Anthropic Messages requests (``/v1/messages``) as the chat request vLLM renders for them.

vLLM (0.32, ``vllm/entrypoints/anthropic/serving.py`` ``to_chat_completion_request``) serves a
Messages request by converting it to a chat-completions request and rendering that with the
model's chat template. This is the same conversion on the request's JSON, so the gateway's
tokenizer (:mod:`gateway.tokenizer`, or the emulated engine's) gives the ids vLLM runs:

* the top-level ``system`` (a string, or text blocks concatenated with no separator, minus Claude
  Code's ``x-anthropic-billing-header`` block) becomes the first system message; with a template
  that rejects a system message after the first (vLLM probes for this), inline ``system``-role
  messages are merged into it, otherwise they stay in place as system messages;
* per message: ``text`` blocks become text parts (one alone: a string); ``thinking`` blocks join
  into ``reasoning``; ``tool_use`` blocks become ``tool_calls`` (arguments: the input as JSON);
  a user's ``tool_result`` blocks become ``tool`` messages *before* that user message (whose
  content, if it had nothing else, is dropped), text items joined with newlines; an assistant's
  become a ``Tool result: ...`` text part; ``redacted_thinking`` and ``tool_reference`` blocks
  are skipped;
* ``tools`` (after ``tool_addition``/``tool_removal`` blocks in system messages) become
  chat-completions function tools (``input_schema`` -> ``parameters``, ``type`` defaulting to
  object); ``thinking`` and ``output_config.effort`` set ``reasoning_effort``.

Images and tool results carrying images or tool references, and tool-use blocks without an id
(vLLM names them by the clock) raise
:class:`engines.vllm.chat_messages.NotExact`: the gateway routes those approximately and counts them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from engines.vllm.chat_messages import NotExact, is_billing
from engines.vllm.dialects.shapes import bad, check_list, check_str

_BLOCK_TYPES = {"text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
                "tool_addition", "tool_removal"}


def to_chat(body: Mapping[str, Any], merge_inline_system: bool = False, disabled_effort: str = "none"
            ) -> dict[str, Any]:
    """The chat-completions body vLLM renders for Messages ``body`` (see the module docstring).
    ``merge_inline_system`` and ``disabled_effort`` are what vLLM probes from the engine's template
    (:class:`gateway.dialects.render.DialectRenderer`)."""
    messages = check_list(body.get("messages"), "messages")
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
            raise bad("each message needs a role of user, assistant or system", "messages")
        content = m.get("content")
        if isinstance(content, list):
            for b in content:
                if not isinstance(b, Mapping) or b.get("type") not in _BLOCK_TYPES:
                    raise bad(f"unsupported content block {b.get('type') if isinstance(b, Mapping) else b!r}",
                              "messages")
                if b["type"] in ("tool_addition", "tool_removal") and m["role"] != "system":
                    raise bad(f'{b["type"]} blocks are only allowed in messages with role "system"', "messages")
        elif not isinstance(content, str):
            raise bad("message content must be a string or a list of content blocks", "messages")
    out: list[dict[str, Any]] = []
    _system(body, messages, out, merge_inline_system)
    for m in messages:
        if m["role"] == "system":
            if not merge_inline_system and (text := _system_text(m)):
                out.append({"role": "system", "content": text})
            continue
        msg: dict[str, Any] = {"role": m["role"]}
        if isinstance(m["content"], str):
            msg["content"] = m["content"]
        else:
            _blocks(m, msg, out)
        if not (m["role"] == "user" and "content" not in msg):
            out.append(msg)
    chat: dict[str, Any] = {"messages": out}
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    effort = _effort(body, disabled_effort)
    if effort is not None:
        chat["reasoning_effort"] = effort
    tools = _tools(body, messages)
    if tools is not None:
        chat["tools"] = tools
    return chat


def _system(body: Mapping[str, Any], messages: list[Any], out: list[dict[str, Any]], merge: bool) -> None:
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            parts.append(system)
    elif isinstance(system, list):
        for b in system:
            if not isinstance(b, Mapping) or b.get("type") not in _BLOCK_TYPES:
                raise bad("system must be a string or a list of text blocks", "system")
            text = b.get("text")
            if b["type"] == "text" and text and not is_billing(text):
                parts.append(check_str(text, "system"))
    elif system is not None:
        raise bad("system must be a string or a list of text blocks", "system")
    if merge:
        parts += [t for m in messages if m["role"] == "system" and (t := _system_text(m))]
    if parts:
        out.append({"role": "system", "content": "".join(parts)})


def _system_text(m: Mapping[str, Any]) -> str | None:
    content = m["content"]
    if isinstance(content, str):
        return None if is_billing(content) else content
    parts = [b["text"] for b in content if b["type"] == "text" and b.get("text") and not is_billing(b["text"])]
    return "".join(parts) if parts else None


def _blocks(m: Mapping[str, Any], msg: dict[str, Any], out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for b in m["content"]:
        kind = b["type"]
        if kind == "text" and b.get("text"):
            parts.append({"type": "text", "text": check_str(b["text"], "messages")})
        elif kind == "image" and b.get("source"):
            raise NotExact("image blocks")
        elif kind == "thinking" and b.get("thinking") is not None:
            reasoning.append(check_str(b["thinking"], "messages"))
        elif kind == "tool_use":
            if not b.get("id"):
                raise NotExact("a tool_use block without an id")
            args = b.get("input") or {}
            if not isinstance(args, Mapping):
                raise bad("a tool_use block's input must be an object", "messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b.get("name") or "", "arguments": json.dumps(args)}})
        elif kind == "tool_result":
            if m["role"] == "user":
                out.extend(_user_tool_result(b))
            else:
                parts.append({"type": "text", "text": f"Tool result: {str(b.get('content')) if b.get('content') else ''}"})
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    if parts:
        msg["content"] = parts[0]["text"] if len(parts) == 1 else parts


def _user_tool_result(b: Mapping[str, Any]) -> list[dict[str, Any]]:
    content = b.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            if not isinstance(item, Mapping):
                continue
            if item.get("type") == "text":
                texts.append(check_str(item.get("text", ""), "messages"))
            elif item.get("type") == "image":
                raise NotExact("images in a tool result")
            elif item.get("type") == "tool_reference" and (item.get("tool_name") or item.get("name")):
                raise NotExact("tool references in a tool result")
        text = "\n".join(texts)
    elif content is not None:
        raise bad("a tool_result's content must be a string or a list of blocks", "messages")
    return [{"role": "tool", "tool_call_id": b.get("tool_use_id") or "", "content": text or ""}]


def _effort(body: Mapping[str, Any], disabled_effort: str) -> str | None:
    """``reasoning_effort`` from ``output_config.effort``, then ``thinking: disabled`` (vLLM's order)."""
    effort = None
    config = body.get("output_config")
    if isinstance(config, Mapping) and config.get("effort") is not None:
        effort = config["effort"]
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") == "disabled":
        effort = disabled_effort
    return effort


def _tool(t: Any) -> dict[str, Any]:
    if not isinstance(t, Mapping) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), Mapping):
        raise bad("each tool needs a name and an input_schema object", "tools")
    schema = dict(t["input_schema"])
    schema.setdefault("type", "object")
    return {**t, "input_schema": schema}


def _tools(body: Mapping[str, Any], messages: list[Any]) -> list[dict[str, Any]] | None:
    """The tools in effect at the end of the conversation, as chat-completions tools."""
    declared = body.get("tools")
    if declared is not None:
        declared = [_tool(t) for t in check_list(declared, "tools", empty=True)]
    changes = [b for m in messages if not isinstance(m["content"], str) for b in m["content"]
               if b["type"] in ("tool_addition", "tool_removal")]
    tools = declared
    if changes:
        by_name = {t["name"]: t for t in declared or []}
        removed: set[str] = set()
        for b in changes:
            change = b.get("tool")
            if not isinstance(change, Mapping):
                raise bad(f"tool is required for {b['type']} blocks", "messages")
            if change.get("type") == "tool_definition":
                if b["type"] == "tool_removal":
                    raise bad("tool_removal only accepts a tool_reference", "messages")
                d = _tool(change.get("definition"))
                name = d["name"]
                by_name[name] = d
            else:
                name = change.get("name")
                if name not in by_name:
                    raise bad(f"{b['type']} references tool {name!r}, which is not declared in tools", "messages")
                if b["type"] == "tool_addition":
                    by_name[name] = {**by_name[name], "defer_loading": None}
            if b["type"] == "tool_removal":
                removed.add(name)
            else:
                removed.discard(name)
        tools = [t for n, t in by_name.items() if n not in removed]
    if tools is None:
        return None
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description"),
                                              "parameters": t["input_schema"], "strict": t.get("strict"),
                                              "defer_loading": t.get("defer_loading")}} for t in tools]
