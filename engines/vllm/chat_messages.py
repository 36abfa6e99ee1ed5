"""Chat messages and tools exactly as vLLM hands them to the chat template.

vLLM (0.32, ``vllm/renderers/chat_utils.py`` ``_parse_chat_message_content`` and
``_postprocess_messages``, ``vllm/renderers/hf.py`` ``safe_apply_chat_template``) does not pass a
request's messages to the template as sent. For a template whose content format is "string" (it
never iterates over ``message.content``), each message becomes:

* ``content``: the text parts (``text``, ``input_text``, ``output_text``: their ``text``;
  ``refusal``: ``refusal``; ``thinking``: ``thinking``) joined with newlines; a missing or null
  content is the empty string, not None; a system message's parts lose a leading
  ``x-anthropic-billing-header`` line (Claude Code's per-request attribution, which would defeat
  prefix caching);
* an assistant's ``tool_calls`` with each ``function.arguments`` parsed from its JSON string into an
  object (``{}`` when empty, malformed or not an object); an empty list dropped; its ``reasoning``
  also given as ``reasoning_content``;
* a tool message's ``tool_call_id``; any message's string ``name`` and ``task``; a developer
  message's ``tools``;
* when the template never names the ``developer`` role and some message has it: developer messages
  become system messages and every system message is merged into one at the front.

Tools are passed as vLLM's ``ChatCompletionToolsParam.model_dump()``: ``{"type": "function",
"function": {"name", "description", "parameters"}}`` with ``strict`` and ``defer_loading`` only
when set. What cannot be reproduced here (media parts, structured tool content such as
``tool_reference``) raises :class:`NotExact`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhit.errors import BadRequestError

BILLING_HEADER = "x-anthropic-billing-header"
_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking"}


class NotExact(Exception):
    """A request the gateway cannot tokenize exactly as vLLM would (the reason is the message)."""


def _part_text(part: Any) -> str | None:
    """One content part's text (None: vLLM skips it), or NotExact for a media part."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise BadRequestError("message content parts must be objects or strings")
    kind = part.get("type")
    key = _TEXT_KEYS.get(kind) if isinstance(kind, str) and part.get("uuid") is None else None
    if key is None:
        raise NotExact(f"message content parts of type {kind!r}")
    text = part.get(key)
    if text is None:
        if kind in ("text", "refusal"):
            return None  # vLLM logs and skips these
        raise NotExact(f"a {kind} part without {key}")
    if not isinstance(text, str):
        raise BadRequestError(f"a {kind} content part's {key} must be a string")
    return text


def is_billing(text: Any) -> bool:
    """Whether ``text`` is Claude Code's billing header block, which vLLM leaves out of the prompt."""
    return isinstance(text, str) and text.startswith(BILLING_HEADER)


def _strip_billing(parts: list[Any]) -> list[Any]:
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
        if not is_billing(text):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def message(m: Mapping[str, Any]) -> dict[str, Any]:
    """One request message as the template sees it (see the module docstring)."""
    role = m.get("role")
    content = m.get("content")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise BadRequestError("messages[].content must be a string or a list of content parts")
    if role == "system":
        parts = _strip_billing(parts)
    texts = [t for t in (_part_text(p) for p in parts) if t is not None]
    out: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _tool_calls(calls)
            if not out["tool_calls"]:
                del out["tool_calls"]
        reasoning = m.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if isinstance(m.get("task"), str):
        out["task"] = m["task"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise BadRequestError("assistant tool_calls must be a list")
    out = []
    for item in calls:
        if not isinstance(item, Mapping):
            raise BadRequestError("assistant tool_calls entries must be objects.")
        function = item.get("function")
        if item.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise BadRequestError("chat completions only support assistant tool_calls of type 'function'.")
        args = function.get("arguments")
        if not args:
            parsed: Any = {}
        elif isinstance(args, Mapping):
            parsed = dict(args)
        elif isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = {}  # vLLM coerces malformed history to {} so the conversation can go on
        else:
            parsed = args
        if not isinstance(parsed, dict):
            parsed = {}
        out.append({**item, "function": {**function, "arguments": parsed}})
    return out


def conversation(messages: Sequence[Mapping[str, Any]], template: str) -> list[dict[str, Any]]:
    """The request's messages as vLLM renders them with ``template`` (see the module docstring)."""
    conv = [message(m) for m in messages]
    if any(m["role"] == "developer" for m in conv) and not ('"developer"' in template or "'developer'" in template):
        conv = _consolidate_system([{k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
                                    if m["role"] == "developer" else m for m in conv])
    return conv


def _consolidate_system(conv: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every system message merged into one at the front (vLLM's ``_consolidate_system_messages``)."""
    systems: list[str] = []
    rest = []
    needed = False
    for i, m in enumerate(conv):
        if m["role"] == "system":
            needed = needed or i > 0 or bool(systems)
            if m.get("content"):
                systems.append(m["content"])
        else:
            rest.append(m)
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest] if needed else conv


def tool_dicts(tools: Any) -> list[dict[str, Any]] | None:
    """Chat-completions ``tools`` as vLLM passes them to the template (see the module docstring)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequestError("tools must be a list")
    return [tool_dict(t) for t in tools]


def tool_dict(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" \
            or not isinstance(tool.get("function"), Mapping):
        raise BadRequestError("each tool must be {'type': 'function', 'function': {...}}")
    f = tool["function"]
    if not isinstance(f.get("name"), str):
        raise BadRequestError("a tool's function needs a name")
    defer = tool.get("defer_loading")
    fd: dict[str, Any] = {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
    if f.get("strict") is not None:
        fd["strict"] = f["strict"]
    fdefer = f.get("defer_loading") if f.get("defer_loading") is not None else defer
    if fdefer is not None:
        fd["defer_loading"] = fdefer
    out: dict[str, Any] = {"type": "function", "function": fd}
    if defer is not None:
        out["defer_loading"] = defer
    return out
