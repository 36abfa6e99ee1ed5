"""gpuhit's own JSONL trace format: round-trips every field of the trace model exactly.

Line 1 is a header ``{"gpuhit_trace": 1, "name", "format", "hash_scope", "source"}`` (``format`` is
the format the trace was first loaded from, so a converted trace keeps saying "weka"). Every further
line is one session: the :class:`~replayer.trace.Session` fields by name, with ``turns`` a list of
objects holding the :class:`~replayer.trace.Turn` fields by name. Fields are written and read by
introspecting the dataclasses, so an optional field added to the model later round-trips too; a
missing optional field takes its default, an unknown one is an error (it would be silently lost).
Floats are written with ``repr`` precision, which ``json`` reads back bit-exactly.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
from pathlib import Path
from typing import IO, Any

from gpuhit.errors import ConfigError, TraceFormatError
from replayer.loaders._common import Problems, as_float, check_hash_ids, check_length, iter_lines
from replayer.trace import Session, Trace, Turn

VERSION = 1
HEADER_KEY = "gpuhit_trace"
_TURN_FIELDS = {f.name: f for f in dataclasses.fields(Turn)}
_SESSION_FIELDS = {f.name: f for f in dataclasses.fields(Session)}
_REQUIRED_TURN = {n for n, f in _TURN_FIELDS.items() if f.default is dataclasses.MISSING}
_REQUIRED_SESSION = {
    n
    for n, f in _SESSION_FIELDS.items()
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def session_record(session: Session) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    for name in _SESSION_FIELDS:
        if name == "turns":
            rec["turns"] = [{n: _plain(getattr(t, n)) for n in _TURN_FIELDS} for t in session.turns]
        else:
            rec[name] = _plain(getattr(session, name))
    return rec


def write_native(trace: Trace, out: str | Path | IO[str]) -> None:
    """Write ``trace`` as native JSONL to a path (gzip when it ends in ``.gz``) or an open text stream."""
    if isinstance(out, (str, Path)):
        path = Path(out)
        try:
            if path.name.endswith(".gz"):
                with io.TextIOWrapper(gzip.open(path, "wb", compresslevel=6), encoding="utf-8") as fh:
                    _write(trace, fh)
            else:
                with open(path, "w", encoding="utf-8") as fh:
                    _write(trace, fh)
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    else:
        _write(trace, out)


def _write(trace: Trace, fh: IO[str]) -> None:
    header = {
        HEADER_KEY: VERSION,
        "name": trace.name,
        "format": trace.format,
        "hash_scope": trace.hash_scope,
        "source": list(trace.source),
    }
    fh.write(json.dumps(header) + "\n")
    for s in trace.sessions:
        fh.write(json.dumps(session_record(s), separators=(",", ":")) + "\n")


def load_native(path: Path, problems: Problems) -> tuple[dict[str, Any], list[Session]]:
    """(header, sessions) of one native file; a missing or unsupported header fails the whole file."""
    header: dict[str, Any] | None = None
    sessions: list[Session] = []
    for number, text in iter_lines(path):
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            if header is None:
                raise TraceFormatError(f"bad JSON in the header: {exc.msg}", str(path), number) from None
            problems.bad(f"bad JSON: {exc.msg}", path, number)
            continue
        if header is None:
            header = _header(rec, path, number)
            continue
        reason, session = _session(rec)
        if reason is not None:
            problems.bad(reason, path, number)
            continue
        sessions.append(session)
    if header is None:
        raise TraceFormatError("empty native trace (no header line)", str(path), None)
    return header, sessions


def _header(rec: Any, path: Path, number: int) -> dict[str, Any]:
    if not isinstance(rec, dict) or HEADER_KEY not in rec:
        raise TraceFormatError(f"first line must be the native header with {HEADER_KEY!r}", str(path), number)
    if rec[HEADER_KEY] != VERSION:
        raise TraceFormatError(
            f"unsupported native trace version {rec[HEADER_KEY]!r} (this gpuhit reads version {VERSION})",
            str(path),
            number,
        )
    source = rec.get("source", [])
    if not (
        isinstance(rec.get("format"), str)
        and isinstance(rec.get("hash_scope"), str)
        and isinstance(source, list)
    ):
        raise TraceFormatError(
            "header needs string 'format', 'hash_scope' and a 'source' list", str(path), number
        )
    return rec


def _session(rec: Any) -> tuple[str | None, Any]:
    if not isinstance(rec, dict):
        return f"session record must be an object, got {type(rec).__name__}", None
    unknown = rec.keys() - _SESSION_FIELDS.keys()
    missing = _REQUIRED_SESSION - rec.keys()
    if unknown or missing:
        return f"session record: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}", None
    sid = rec["session_id"]
    bs = rec["block_size"]
    if not isinstance(sid, str) or type(bs) is not int or bs <= 0 or not isinstance(rec["namespace"], str):
        return "session_id and namespace must be strings and block_size a positive integer", None
    if not isinstance(rec["turns"], list) or not rec["turns"]:
        return f"session {sid}: 'turns' must be a non-empty list", None
    turns = []
    for k, t in enumerate(rec["turns"]):
        if not isinstance(t, dict):
            return f"session {sid} turn {k}: must be an object", None
        unknown = t.keys() - _TURN_FIELDS.keys()
        missing = _REQUIRED_TURN - t.keys()
        if unknown or missing:
            return (
                f"session {sid} turn {k}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}",
                None,
            )
        reason = (
            check_length(t["input_length"], "input_length")
            or check_length(t["output_length"], "output_length")
            or check_hash_ids(t["hash_ids"], t["input_length"], bs, allow_empty=True)
        )
        for name in ("think_time", "offset"):
            if reason is None and name in t and (as_float(t[name]) is None or t[name] < 0):
                reason = f"{name} must be a non-negative number, got {t[name]!r}"
        if reason is not None:
            return f"session {sid} turn {k}: {reason}", None
        fields = dict(t)
        fields["hash_ids"] = tuple(t["hash_ids"])
        for name in ("think_time", "offset"):
            if name in fields:
                fields[name] = float(fields[name])
        try:
            turns.append(Turn(**fields))
        except TypeError as exc:
            return f"session {sid} turn {k}: {exc}", None
    fields = dict(rec)
    fields["turns"] = tuple(turns)
    if "arrival" in fields:
        if as_float(fields["arrival"]) is None:
            return f"session {sid}: arrival must be a number", None
        fields["arrival"] = float(fields["arrival"])
    parent = fields.get("parent")
    if parent is not None and not isinstance(parent, str):
        return f"session {sid}: parent must be a string or null", None
    st = fields.get("system_tokens", 0)
    if type(st) is not int or st < 0:
        return f"session {sid}: system_tokens must be a non-negative integer", None
    return None, Session(**fields)
