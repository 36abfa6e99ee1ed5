"""WEKA Claude Code conversations (kv-cache-tester ``traces/``): one JSON document per conversation.

File: ``{id, models, block_size, hash_id_scope: "local", tool_tokens, system_tokens, requests}``.
A request is ``{t, type, model, in, out, hash_ids, api_time, think_time, ...}`` with ``t`` in seconds
from the conversation start; a ``type: "subagent"`` entry instead nests its own ``requests`` whose
``t`` is relative to the sub-agent's start (the entry's own ``t``).

Mapping to the trace model:

- the conversation is a root :class:`Session` (id and namespace = the file's ``id``: hash ids are
  scoped per conversation); each sub-agent a child session ``"<id>/<agent_id>"`` with
  ``parent`` = the enclosing session, the *same* namespace (ids are numbered per file), its own
  model and ``system_tokens``, and ``arrival`` = parent arrival + the entry's ``t``;
- ``Turn.offset`` is the recorded ``t`` (relative to its own session's start);
- ``Turn.think_time`` is the recorded ``think_time``; when missing, the gap between the previous
  turn's end (``t + api_time``) and this turn's ``t`` (clamped at 0). The first turn's is 0;
- WEKA gives ids only for *full* 64-token blocks (``len(hash_ids) == in // 64``); the remainder
  of a prompt is new text that the token synthesizer makes unique to the turn.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from replayer.loaders._common import Problems, as_float, check_hash_ids, check_length, read_bytes
from replayer.trace import Session, Turn


def load_weka(path: Path, problems: Problems) -> list[Session]:
    """Sessions of one WEKA conversation file (root first, then sub-agents in file order)."""
    try:
        # orjson: a conversation file parses ~2-3x faster than with json.loads (trace loading was a
        # tenth of a run of the bundled slice); its JSONDecodeError is json's, with msg and lineno
        doc = orjson.loads(read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        problems.bad(f"bad JSON: {getattr(exc, 'msg', exc)}", path, getattr(exc, "lineno", None))
        return []
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        problems.bad("not a WEKA conversation (an object with a 'requests' list)", path, 1)
        return []
    block_size = doc.get("block_size", 64)
    if type(block_size) is not int or block_size <= 0:
        problems.bad(f"block_size must be a positive integer, got {block_size!r}", path, 1)
        return []
    conv_id = doc.get("id")
    if not isinstance(conv_id, str) or not conv_id:
        conv_id = _stem(path)
    sessions: list[Session] = []
    # one int object per hash id of the file: the turns of a conversation repeat their predecessors'
    # ids, and the replayer compares those tuples per request (the longest shared prefix); equal
    # objects compare by identity, ~4x faster than equal values, and the trace holds fewer ints
    _session(doc, conv_id, conv_id, None, 0.0, block_size, path, problems, sessions, where="", ids_of={})
    return sessions


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".json", ".jsonl"):
        name = name.removesuffix(suffix)
    return name


def _session(
    entry: dict[str, Any],
    session_id: str,
    namespace: str,
    parent: str | None,
    arrival: float,
    block_size: int,
    path: Path,
    problems: Problems,
    out: list[Session],
    where: str,
    ids_of: dict[int, int],
) -> None:
    """Append the session described by ``entry`` (and, after it, its sub-agents) to ``out``;
    ``ids_of``: the file's hash ids, each to its one int object."""
    turns: list[Turn] = []
    children: list[tuple[int, dict[str, Any]]] = []
    prev_end: float | None = None
    prev_t: float | None = None
    for index, req in enumerate(entry["requests"]):
        loc = f"{where}requests[{index}]"
        if not isinstance(req, dict):
            problems.bad(f"{loc}: request must be an object, got {type(req).__name__}", path, None)
            continue
        if req.get("type") == "subagent":
            children.append((index, req))
            continue
        turn = _turn(req, block_size, prev_end, prev_t, not turns, loc, path, problems, ids_of)
        if turn is None:
            continue
        turns.append(turn)
        api = as_float(req.get("api_time"))
        prev_t = turn.offset
        prev_end = turn.offset + api if api is not None and api >= 0 else None
    if turns:
        system_tokens = entry.get("system_tokens", 0)
        out.append(
            Session(
                session_id=session_id,
                turns=tuple(turns),
                block_size=block_size,
                namespace=namespace,
                arrival=arrival,
                parent=parent,
                model=turns[0].model,
                system_tokens=system_tokens if type(system_tokens) is int and system_tokens > 0 else 0,
            )
        )
    for index, sub in children:
        loc = f"{where}requests[{index}]"
        t = as_float(sub.get("t"))
        if t is None or t < 0:
            problems.bad(
                f"{loc}: sub-agent 't' must be a non-negative number, got {sub.get('t')!r}", path, None
            )
            continue
        if not isinstance(sub.get("requests"), list):
            problems.bad(f"{loc}: sub-agent must have a 'requests' list", path, None)
            continue
        agent = sub.get("agent_id")
        agent = agent if isinstance(agent, str) and agent else f"subagent{index}"
        # A child of a dropped (all-bad) parent still runs: it keeps the parent id it was recorded under.
        _session(
            sub,
            f"{session_id}/{agent}",
            namespace,
            session_id,
            arrival + t,
            block_size,
            path,
            problems,
            out,
            where=f"{loc}.",
            ids_of=ids_of,
        )


def _turn(
    req: dict[str, Any],
    block_size: int,
    prev_end: float | None,
    prev_t: float | None,
    first: bool,
    loc: str,
    path: Path,
    problems: Problems,
    ids_of: dict[int, int],
) -> Turn | None:
    t = as_float(req.get("t"))
    if t is None or t < 0:
        problems.bad(f"{loc}: 't' must be a non-negative number, got {req.get('t')!r}", path, None)
        return None
    n_in, n_out = req.get("in"), req.get("out")
    reason = check_length(n_in, "input length 'in'") or check_length(n_out, "output length 'out'")
    if reason is None:
        ids = req.get("hash_ids")
        reason = check_hash_ids(ids, n_in, block_size, allow_empty=False)
    if reason is not None:
        problems.bad(f"{loc}: {reason}", path, None)
        return None
    if first:
        think = 0.0
    else:
        think = as_float(req.get("think_time"))
        if think is None or think < 0:
            # Closed loop: the user/tool time is what elapsed between the previous answer and this send.
            ref = prev_end if prev_end is not None else prev_t
            think = max(0.0, t - ref) if ref is not None else 0.0
    model = req.get("model")
    return Turn(
        input_length=n_in,
        output_length=n_out,
        hash_ids=tuple(map(ids_of.setdefault, ids, ids)),
        think_time=think,
        offset=t,
        model=model if isinstance(model, str) else "",
    )
