"""Shared plumbing of the trace loaders: transparent gzip, per-record problems, cheap validation.

Every loader reports a bad record the same way: ``Problems.bad(reason, path, line)`` raises a
:class:`~gpuhit.errors.TraceFormatError` in strict mode, otherwise counts the record as skipped and
remembers the first few ``"file:line: reason"`` messages for the user. Validation is per record and
deliberately cheap (a full WEKA folder holds ~23 M hash ids): ``sum()`` over the id list runs in C
and both rejects non-numbers (TypeError) and reveals a float (the sum is then a float).
"""

from __future__ import annotations

import gzip
import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from gpuhit.errors import TraceFormatError

MAX_PROBLEMS = 20  # messages kept for the user; the count of skipped records is always exact


def open_text(path: Path) -> IO[str]:
    """Open ``path`` for reading text, decompressing gzip when its magic bytes say so (not by name)."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(2)
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace file: {exc.strerror or exc}", str(path)) from None
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def read_bytes(path: Path) -> bytes:
    """The whole (decompressed) content of ``path``; one read is the fastest way into ``json.loads``."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise TraceFormatError(f"cannot read trace file: {exc.strerror or exc}", str(path)) from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TraceFormatError(f"corrupt gzip data: {exc}", str(path)) from None
    return data


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, stripped text)`` of every non-blank line (1-based numbers, as editors show)."""
    try:
        with open_text(path) as fh:
            for number, line in enumerate(fh, 1):
                text = line.strip()
                if text:
                    yield number, text
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"cannot read trace file: {exc}", str(path)) from None


class Problems:
    """Collects bad records: raise when strict, else count + keep the first messages."""

    __slots__ = ("messages", "skipped", "strict")

    def __init__(self, strict: bool):
        self.strict = strict
        self.skipped = 0
        self.messages: list[str] = []

    def bad(self, reason: str, path: Path | str, line: int | None) -> None:
        err = TraceFormatError(reason, str(path), line)
        if self.strict:
            raise err
        self.skipped += 1
        if len(self.messages) < MAX_PROBLEMS:
            self.messages.append(str(err))


def check_length(value: Any, what: str) -> str | None:
    """None when ``value`` is a valid token count, else the reason (negative or wrong type)."""
    if type(value) is int:
        return None if value >= 0 else f"negative {what} {value}"
    return f"{what} must be a non-negative integer, got {type(value).__name__} {value!r}"[:200]


def check_hash_ids(ids: Any, input_length: int, block_size: int, allow_empty: bool) -> str | None:
    """None when ``ids`` is a list of ints covering ``input_length`` at ``block_size``, else the reason.

    Covering means ``len(ids)`` is ``ceil(input/bs)`` (Mooncake, Bailian: the last, partial block has
    an id) or ``floor(input/bs)`` (WEKA: only full blocks have ids; the rest is new text). An empty
    list is accepted only where the format carries no ids at all (Azure, and native files made from
    it).
    """
    if not isinstance(ids, list):
        return f"hash_ids must be a list of integers, got {type(ids).__name__}"
    n = len(ids)
    if n == 0 and allow_empty:
        return None
    if n:
        try:
            total = sum(ids)
        except TypeError:
            total = None
        if type(total) is not int or any(type(x) is bool for x in (ids[0], ids[-1])):
            bad = next((x for x in ids if type(x) is not int), None)
            return f"hash_ids must be integers, found {type(bad).__name__} {bad!r}"[:200]
    full, ceil = input_length // block_size, math.ceil(input_length / block_size)
    if n != full and n != ceil:
        want = f"{ceil}" if full == ceil else f"{full} or {ceil}"
        return (
            f"{n} hash_ids do not cover input_length {input_length} at block size {block_size} "
            f"(expected {want})"
        )
    return None


def as_float(value: Any) -> float | None:
    """A finite JSON number as float, else None (bools rejected)."""
    if type(value) is int or type(value) is float:
        f = float(value)
        return f if math.isfinite(f) else None
    return None
