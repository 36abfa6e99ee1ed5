"""The router's request and decision records: frozen ``msgspec.Struct`` records, in a module of their
own because :mod:`gateway.router` may be compiled with mypyc (:mod:`gpuhit.native`), which turns a
class's ``frozen=True`` into nothing; here they stay frozen, hashable and picklable either way.
:mod:`gateway.router` re-exports both."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec


class RouteRequest(msgspec.Struct, frozen=True):
    """What the router needs to know about one request. ``block_hashes``: the prompt's full blocks'
    hashes, a tuple or a lazily hashed :class:`engines.hashing.PromptHashes` (the router reads only
    as far as the index's search goes)."""

    request_id: str
    prompt_len: int
    max_tokens: int
    block_hashes: Sequence[int]
    prompt_token_ids: Sequence[int] | None = None
    session_id: str | None = None
    parent_session: str | None = None
    turn: int = 0


class RouteRecord(msgspec.Struct, frozen=True):
    """One routing decision, as logged through ``decision_sink``."""

    request_id: str
    session: str | None
    policy: str
    action: str
    target: int
    source: int | None
    reason: str
    scores: tuple[tuple[int, float], ...]
    predicted_hit_blocks: int
    now: float
