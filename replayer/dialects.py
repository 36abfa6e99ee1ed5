"""A trace's turns as requests of each API a live replay speaks (``gpuhit replay --api``): OpenAI
completions, chat, Anthropic Messages or OpenAI Responses.

Completions requests carry the turn's token ids (:class:`~replayer.synth.TokenSynthesizer`).
The text dialects carry a conversation instead, built here from the same ids so that the prefix
structure of the trace survives: turn k's prompt is cut where earlier turns' prompts ended (those
still inside the prefix it shares with turn k - 1, recursively), each piece a message: the part
that was turn j's output is an assistant message, the rest a user message. Two turns that share a
prefix of ids therefore share those messages verbatim, and the engines' prefix cache sees the same
reuse through the chat template (up to where a message's rendering begins to differ). A token id
becomes one word of a fixed list, so the tokenizer sees roughly as many tokens as the trace says.

Each dialect's stream is read for what the records need: the first token, the output tokens and
the realized prefix hit (``usage.prompt_tokens_details.cached_tokens``,
``cache_read_input_tokens``, ``input_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engines.vllm import protocol
from gpuhit.errors import ConfigError

APIS = ("completions", "chat", "messages", "responses")
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}
_WORD_TEXT = ("the a to of and in is it for on that with as at by from this be are or an not was which can all one "
              "more engine cache block token prefix route query session turn agent tool file read write patch test "
              "build run gateway policy load hit miss queue batch decode prefill model request reply trace replay "
              "index hash store user assistant system result error value list map key node edge graph path step")
_WORDS = tuple(_WORD_TEXT.split(" "))


def words(ids: Sequence[int]) -> str:
    """The text standing for ``ids``: one word per id."""
    n = len(_WORDS)
    return " ".join(_WORDS[i % n] for i in ids)


class Conversations:
    """Per session turn, the conversation (role, ids) pieces that stand for its prompt (see the
    module docstring). Memoizes each turn's cut positions (one int pair per earlier turn kept)."""

    def __init__(self, synth: Any):
        self.synth = synth
        self._cuts: dict[tuple[str, int], list[tuple[int, int]]] = {}

    def cuts(self, session: Any, k: int) -> list[tuple[int, int]]:
        """(position, output tokens at its start) of each piece of turn ``k``'s prompt."""
        key = (session.session_id, k)
        got = self._cuts.get(key)
        if got is not None:
            return got
        if k == 0:
            cuts = [(0, 0)]
        else:
            prev = session.turns[k - 1]
            shared = self.synth.common_prefix_tokens(session, k - 1, session, k)
            cuts = [c for c in self.cuts(session, k - 1) if c[0] <= shared]
            if cuts[-1][0] < prev.input_length <= shared and prev.input_length < session.turns[k].input_length:
                cuts.append((prev.input_length, prev.output_length))
        self._cuts[key] = cuts
        self._cuts.pop((session.session_id, k - 2), None)  # a session's turns come in order
        return cuts

    def messages(self, session: Any, k: int, ids: Sequence[int]) -> list[tuple[str, str]]:
        """(role, text) of turn ``k``, the last always the user's."""
        cuts = self.cuts(session, k)
        out: list[tuple[str, str]] = []
        ends = [c[0] for c in cuts[1:]] + [len(ids)]
        for (start, produced), end in zip(cuts, ends):
            mid = min(start + produced, end)
            if mid > start:
                out.append(("assistant", words(ids[start:mid])))
            if end > mid:
                out.append(("user", words(ids[mid:end])))
        if not out or out[-1][0] != "user":
            out.append(("user", "continue"))
        return out


def turn_body(api: str, conversations: Conversations, session: Any, k: int, ids: list[int], max_tokens: int,
              model: str) -> dict[str, Any]:
    """The streamed request of ``api`` for turn ``k`` of ``session`` (prompt ``ids``): the ids
    themselves for completions (vLLM's replay request), else the conversation standing for them."""
    if api == "completions":
        return protocol.completion_request(ids, max_tokens, model)
    return request_body(api, conversations.messages(session, k, ids), max_tokens, model)


def request_body(api: str, messages: list[tuple[str, str]], max_tokens: int, model: str) -> dict[str, Any]:
    """The streamed request of ``api`` for this conversation, asking for ``max_tokens`` tokens
    (chat also sends ``min_tokens`` and ``ignore_eos``; Messages and Responses have no such fields)."""
    if api == "chat":
        return {"model": model, "messages": [{"role": r, "content": t} for r, t in messages], "max_tokens": max_tokens,
                "min_tokens": max_tokens, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if api == "messages":
        return {"model": model, "max_tokens": max_tokens, "stream": True,
                "messages": [{"role": r, "content": t} for r, t in messages]}
    if api == "responses":
        return {"model": model, "max_output_tokens": max_tokens, "stream": True, "store": False,
                "input": [{"role": r, "content": t} for r, t in messages]}
    raise ConfigError(f"--api {api!r}: choose one of {', '.join(APIS)}")


def observe(api: str, obj: dict[str, Any], rec: Any, now: float) -> None:
    """Fold one streamed event of ``api`` into the record (first token, output tokens, prefix hit)."""
    kind = obj.get("type")
    if api in ("completions", "chat"):
        choices = obj.get("choices")
        # A chunk per generated token, whose text may be "" (a partial UTF-8 character); vLLM's
        # first chat chunk carries only the role, before any token.
        if choices and "role" not in (choices[0].get("delta") or {}) and math.isnan(rec.first_token):
            rec.first_token = now
        u = obj.get("usage")
        if u:
            rec.output_tokens = int(u.get("completion_tokens") or 0)
            rec.realized_hit_tokens = protocol.cached_tokens_of(u) or 0
    elif api == "messages":
        if kind in ("content_block_delta", "message_delta") and math.isnan(rec.first_token):
            rec.first_token = now
        if kind == "message_delta":
            u = obj.get("usage") or {}
            rec.output_tokens = int(u.get("output_tokens") or 0)
            rec.realized_hit_tokens = int(u.get("cache_read_input_tokens") or 0)
        elif kind == "error":
            rec.error = str((obj.get("error") or {}).get("message"))
    elif api == "responses":
        if kind in ("response.output_text.delta", "response.completed") and math.isnan(rec.first_token):
            rec.first_token = now
        if kind == "response.completed":
            u = (obj.get("response") or {}).get("usage") or {}
            rec.output_tokens = int(u.get("output_tokens") or 0)
            rec.realized_hit_tokens = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
        elif kind in ("error", "response.failed"):
            rec.error = str(obj.get("message") or obj)


def finished(api: str, obj: dict[str, Any]) -> bool:
    """Whether ``obj`` is the stream's last event (Messages and Responses send no ``[DONE]``;
    completions and chat end with it, read by the caller)."""
    return (api == "messages" and obj.get("type") == "message_stop") or \
        (api == "responses" and obj.get("type") in ("response.completed", "response.failed", "response.incomplete"))
