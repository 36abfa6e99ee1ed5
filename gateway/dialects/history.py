"""Where each stored Responses answer lives, and the messages a request naming it starts with.

A response stored by an engine (vLLM's ``store``, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) lives
in that engine's memory only: a later ``previous_response_id``, ``GET /v1/responses/{id}`` or
``cancel`` of it works only there. :class:`ResponseHistory` remembers, per response id the gateway
saw answered, which engine holds it and what a request naming it renders before its own input
(:func:`engines.vllm.dialects.responses.to_chat`'s ``previous``), so such a request is routed there
and tokenized exactly. With ``--share`` the entries are also published to the other gateway
replicas (:class:`gateway.share.ShareLink` sets :attr:`ResponseHistory.on_record` and applies
theirs with :meth:`ResponseHistory.apply`), so a continuation arriving at any replica finds them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engines.vllm.dialects.responses import output_messages
from gpuhit.errors import NotFoundError


class ResponseHistory:
    """Where each stored response lives, and what a request naming it starts with (bounded LRU).

    vLLM keeps a stored response (``store``, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the
    memory of the engine that answered it: a later ``previous_response_id``, ``GET`` or ``cancel``
    of it works only there. The gateway records the engine and, for exact tokenization of the next
    turn, that request's messages (vLLM's ``msg_store``) plus the response's output messages.
    """

    def __init__(self, max_entries: int = 65536):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, list[dict[str, Any]] | None, str]] = OrderedDict()
        # Called with each locally recorded entry (id, engine, messages after, session): the
        # shared-state link publishes it. Entries from peers (apply) are not reported back.
        self.on_record: Callable[[str, str, list[dict[str, Any]] | None, str], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, response_id: str, engine: str, messages: Sequence[Mapping[str, Any]] | None,
               response: Mapping[str, Any] | None, session: str | None = None) -> None:
        """``response_id`` answered by ``engine``; ``messages``: the chat messages its request
        rendered (None when not known exactly); ``response``: the finished response body;
        ``session``: the conversation it belongs to (a chain keeps its first turn's session)."""
        after = None
        if messages is not None and response is not None:
            after = [dict(m) for m in messages if m.get("role") != "system"] + output_messages(response)
        # A chain whose first turn named no session is keyed by that first response's id.
        session = session if session is not None else response_id
        self.apply(response_id, engine, after, session)
        if self.on_record is not None:
            self.on_record(response_id, engine, after, session)

    def apply(self, response_id: str, engine: str, after: list[dict[str, Any]] | None, session: str) -> None:
        """Store an entry as it is (a peer replica's, already resolved): idempotent, LRU-bounded."""
        self._entries[response_id] = (engine, after, session)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def engine_of(self, response_id: str) -> str | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[0]

    def holder(self, response_id: str, names: Sequence[str], param: str) -> int:
        """The index in ``names`` (the engines served) of the engine holding ``response_id``. A
        response the gateway has no record of, or whose engine is no longer served, is vLLM's 404
        (``param``: the field that named the id), never a guess at another engine."""
        name = self.engine_of(response_id)
        if name is not None and name in names:
            return names.index(name)
        why = ("the gateway has no record of it (never answered through this gateway, or forgotten: the "
               "history is bounded, and an engine that restarted lost its stored responses)" if name is None
               else f"engine {name} that stored it is no longer served")
        err = NotFoundError(f"Response with id '{response_id}' not found: {why}.")
        err.param = param  # type: ignore[attr-defined]
        err.error_type = "invalid_request_error"  # type: ignore[attr-defined]
        raise err

    def messages_after(self, response_id: str) -> list[dict[str, Any]] | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[1]

    def session_of(self, response_id: str) -> str | None:
        entry = self._entries.get(response_id)
        return None if entry is None else entry[2]

    def forget_engine(self, engine: str) -> int:
        """Drop every response held by ``engine`` (it restarted: its memory is gone, and a request
        naming one of them gets the gateway's 404 instead of the engine's); how many."""
        gone = [k for k, entry in self._entries.items() if entry[0] == engine]
        for k in gone:
            del self._entries[k]
        return len(gone)
