"""Request-per-line JSONL traces: Mooncake (FAST'25) and Alibaba Qwen-Bailian.

Mooncake: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``, block 512, ids global
to the file (namespace = the file's stem). It has no session ids; with ``infer_sessions`` they are
rebuilt from hash-id prefix chains (see :func:`infer_sessions`), else every request is its own
session.

Bailian: ``{"chat_id", "parent_chat_id" (-1 = root), "timestamp": s, "input_length",
"output_length", "type", "turn", "hash_ids"}``, block 16, ids global. A session is a root chat and
every chat that descends from it through ``parent_chat_id``; a chat whose parent is not in the file
(sampled traces) starts a session of its own.

For both, ``Session.arrival`` is the first request's timestamp in seconds, ``Turn.offset`` the
request's timestamp minus that, and the closed-loop ``Turn.think_time`` of turn k>0 is the whole gap
between the recorded sends of turns k-1 and k: the traces do not record service times, so the
recorded gap is the best available bound (a closed-loop replay of these traces therefore runs
somewhat longer than the recording).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replayer.loaders._common import Problems, as_float, check_hash_ids, check_length, iter_lines
from replayer.trace import Session, Turn

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16
# Every Mooncake request starts with the same block 0 (a shared system prompt): a continuation must
# share at least this many leading blocks with an earlier request of its session.
MIN_SHARED_BLOCKS = 2


@dataclass(slots=True)
class _Req:
    line: int
    time: float  # seconds
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    chat_id: int = -1
    parent: int = -1


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def _records(path: Path, problems: Problems, block_size: int, time_scale: float, bailian: bool) -> list[_Req]:
    out: list[_Req] = []
    for number, text in iter_lines(path):
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.bad(f"bad JSON: {exc.msg}", path, number)
            continue
        if not isinstance(rec, dict):
            problems.bad(f"record must be a JSON object, got {type(rec).__name__}", path, number)
            continue
        ts = as_float(rec.get("timestamp"))
        n_in, n_out = rec.get("input_length"), rec.get("output_length")
        reason = None
        if ts is None or ts < 0:
            reason = f"timestamp must be a non-negative number, got {rec.get('timestamp')!r}"
        reason = (
            reason
            or check_length(n_in, "input_length")
            or check_length(n_out, "output_length")
            or check_hash_ids(rec.get("hash_ids"), n_in, block_size, allow_empty=False)
        )
        chat = parent = -1
        if reason is None and bailian:
            chat, parent = rec.get("chat_id"), rec.get("parent_chat_id", -1)
            if type(chat) is not int or type(parent) is not int:
                reason = f"chat_id and parent_chat_id must be integers, got {chat!r}, {parent!r}"
        if reason is not None:
            problems.bad(reason, path, number)
            continue
        out.append(_Req(number, ts * time_scale, n_in, n_out, tuple(rec["hash_ids"]), chat, parent))
    return out


def _session(sid: str, namespace: str, block_size: int, reqs: list[_Req]) -> Session:
    start = reqs[0].time
    turns = []
    prev = start
    for r in reqs:
        turns.append(
            Turn(
                input_length=r.input_length,
                output_length=r.output_length,
                hash_ids=r.hash_ids,
                think_time=r.time - prev,
                offset=r.time - start,
            )
        )
        prev = r.time
    return Session(
        session_id=sid, turns=tuple(turns), block_size=block_size, namespace=namespace, arrival=start
    )


def load_mooncake(path: Path, problems: Problems, infer: bool = True) -> list[Session]:
    reqs = _records(path, problems, MOONCAKE_BLOCK, 1e-3, bailian=False)
    reqs.sort(key=lambda r: r.time)  # stable: equal timestamps keep file order
    stem = _stem(path)
    groups = infer_sessions([r.hash_ids for r in reqs]) if infer else [[i] for i in range(len(reqs))]
    return [_session(f"{stem}#{k}", stem, MOONCAKE_BLOCK, [reqs[i] for i in g]) for k, g in enumerate(groups)]


def infer_sessions(hash_ids: list[tuple[int, ...]], min_shared: int = MIN_SHARED_BLOCKS) -> list[list[int]]:
    """Group requests (in send order) into sessions by hash-id prefix chains; returns index lists.

    Rule: request r continues the session of the earlier request q whose *full-context* prefix,
    ``q.hash_ids[:-1]``, is the longest one that is a prefix of ``r.hash_ids`` and is at least
    ``min_shared`` blocks long (on ties, the most recent q). ``q``'s last block is left out because it
    is partial (its id changes once the answer and the next message fill it); the minimum length of
    2 ignores the block 0 that every Mooncake request shares. Any earlier turn of a session may be
    extended, not only its last (regenerations and edits branch from an earlier point).

    On the FAST'25 conversation trace this gives 8,057 sessions of which 2,012 multi-turn (the
    published analysis: ~8,067 / 2,012).
    """
    owner: dict[tuple[int, ...], int] = {}  # prefix -> session index (latest writer wins)
    sessions: list[list[int]] = []
    for i, ids in enumerate(hash_ids):
        found = -1
        for length in range(len(ids), min_shared - 1, -1):
            s = owner.get(ids[:length])
            if s is not None:
                found = s
                break
        if found < 0:
            found = len(sessions)
            sessions.append([])
        sessions[found].append(i)
        if len(ids) - 1 >= min_shared:
            owner[ids[:-1]] = found
    return sessions


def load_bailian(path: Path, problems: Problems) -> list[Session]:
    reqs = _records(path, problems, BAILIAN_BLOCK, 1.0, bailian=True)
    reqs.sort(key=lambda r: r.time)
    stem = _stem(path)
    root_of: dict[int, int] = {}
    members: dict[int, list[_Req]] = {}
    seen_chat: set[int] = set()
    for r in reqs:
        if r.chat_id in seen_chat:
            # two records with one chat_id would make the session tree ambiguous
            problems.bad(f"duplicate chat_id {r.chat_id}", path, r.line)
            continue
        seen_chat.add(r.chat_id)
        root = root_of.get(r.parent, r.chat_id) if r.parent >= 0 else r.chat_id
        root_of[r.chat_id] = root
        members.setdefault(root, []).append(r)
    return [_session(f"{stem}#{root}", stem, BAILIAN_BLOCK, rs) for root, rs in members.items()]


def sniff_record(rec: Any) -> str | None:
    """Which of the JSONL formats one parsed record belongs to, or None."""
    if not isinstance(rec, dict):
        return None
    if "chat_id" in rec:
        return "bailian"
    if "input_length" in rec and "hash_ids" in rec:
        return "mooncake"
    return None
