"""Which conversation a request belongs to, from what agentic clients send.

Bindings (a session kept on the engine holding its prefix) and the session priority the policies
use need a session key. Clients name it in different places:

* a header: ``x-session-id`` (gpuhit's own, and the replayer's), ``x-claude-code-session-id``
  (Claude Code), ``session_id`` / ``conversation_id`` (Codex CLI);
* Anthropic Messages: ``metadata.user_id`` (Claude Code puts its session id in it);
* OpenAI Responses: ``prompt_cache_key`` (Codex sets it to its conversation id), ``conversation``
  (an id, or ``{"id": ...}``), or the session of the response named by ``previous_response_id``
  (a chain is one conversation).

The first one present wins, headers first: an explicit header is the operator's or replayer's
choice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session_id", "session-id", "conversation_id",
                   "x-conversation-id")
MAX_LEN = 256  # a session key is a dictionary key and a header value: bounded


def _key(value: Any) -> str | None:
    return value[:MAX_LEN] if isinstance(value, str) and value else None


def from_headers(headers: Mapping[str, str]) -> str | None:
    for name in SESSION_HEADERS:
        if (s := _key(headers.get(name))) is not None:
            return s
    return None


def anthropic_session(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    s = from_headers(headers)
    if s is None:
        meta = body.get("metadata")
        s = _key(meta.get("user_id")) if isinstance(meta, Mapping) else None
    return s


def responses_session(headers: Mapping[str, str], body: Mapping[str, Any],
                      session_of_response: Callable[[str], str | None] | None = None) -> str | None:
    s = from_headers(headers) or _key(body.get("prompt_cache_key"))
    if s is None:
        conv = body.get("conversation")
        s = _key(conv.get("id")) if isinstance(conv, Mapping) else _key(conv)
    prev = body.get("previous_response_id")
    if s is None and isinstance(prev, str) and session_of_response is not None:
        s = session_of_response(prev)
    return s
