"""Azure LLM inference trace 2023 (AzurePublicDataset): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``.

Arrivals and lengths only: there is no reuse information and no session structure, so every request
is a single-turn session with empty ``hash_ids`` (the synthesizer then makes its whole prompt
unique) and the trace's ``hash_scope`` is ``"none"``. ``Session.block_size`` is a nominal 16.
Arrival is the timestamp's distance from the file's first record, in seconds.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from replayer.loaders._common import Problems, iter_lines
from replayer.trace import Session, Turn

NOMINAL_BLOCK = 16
HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _parse_time(text: str) -> tuple[datetime, float]:
    """(whole-second datetime, fraction): 7-digit fractions are kept exactly, unlike fromisoformat."""
    main, _, frac = text.partition(".")
    if frac and not frac.isdigit():
        raise ValueError(f"bad fraction {frac!r}")
    return datetime.fromisoformat(main), float(f"0.{frac}") if frac else 0.0


def load_azure(path: Path, problems: Problems) -> list[Session]:
    stem = path.name.removesuffix(".gz").removesuffix(".csv")
    sessions: list[Session] = []
    first: tuple[datetime, float] | None = None
    header_seen = False
    for number, text in iter_lines(path):
        cells = [c.strip() for c in text.split(",")]
        if not header_seen:
            header_seen = True
            if tuple(cells) == HEADER:
                continue
        if len(cells) != 3:
            problems.bad(
                f"expected 3 comma-separated fields {','.join(HEADER)}, got {len(cells)}", path, number
            )
            continue
        try:
            when = _parse_time(cells[0])
        except ValueError:
            problems.bad(f"bad TIMESTAMP {cells[0]!r} (expected 'YYYY-MM-DD HH:MM:SS.fffffff')", path, number)
            continue
        try:
            n_in, n_out = int(cells[1]), int(cells[2])
        except ValueError:
            problems.bad(
                f"ContextTokens and GeneratedTokens must be integers, got {cells[1]!r}, {cells[2]!r}",
                path,
                number,
            )
            continue
        if n_in < 0 or n_out < 0:
            problems.bad(f"negative token count ({n_in}, {n_out})", path, number)
            continue
        if first is None:
            first = when
        arrival = (when[0] - first[0]).total_seconds() + (when[1] - first[1])
        if arrival < 0:
            problems.bad(f"timestamp {cells[0]} precedes the file's first record", path, number)
            continue
        turn = Turn(input_length=n_in, output_length=n_out, hash_ids=())
        sessions.append(
            Session(
                session_id=f"{stem}#{len(sessions)}",
                turns=(turn,),
                block_size=NOMINAL_BLOCK,
                namespace=stem,
                arrival=arrival,
            )
        )
    if not header_seen:
        problems.bad("empty file", path, None)
    sessions.sort(key=lambda s: s.arrival)
    return sessions
