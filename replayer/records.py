"""One row per replayed request, written append-only and resumable.

A :class:`RequestRecord` is what the replayer keeps about one turn it sent (or failed to send):
when it was sent and answered, where it went and why, and how much of its prompt was served from a
prefix cache versus how much the trace says *could* have been.

Storage is CSV by default (Parquet is offered only when ``pyarrow`` is importable, as a conversion
of a finished CSV, because Parquet files cannot be appended to row by row). :class:`RecordWriter`
flushes each row as it is written, so a crash loses at most the row being written.

Resume semantics (documented contract): opening a :class:`RecordWriter` on an existing file with
``resume=True`` reads the rows already there; every ``(session, turn)`` that has a row - successful
*or failed* - counts as done, and :attr:`RecordWriter.done` lists them so the driver does not send
them again. A failed turn is therefore not retried on resume (its error row is the outcome of the
run). A torn last line (the process died mid-write) is discarded and rewritten. One file holds one
run: rows from another policy or seed in the file are a :class:`~gpuhit.errors.ConfigError`.

Engine-side columns (:class:`EngineTimedRecord`, :data:`ENGINE_COLUMNS`): the engine's own timing
of each request (vLLM's per-request span, or the emulator's timestamps), written only when asked for
(``engine_columns=True``): a file without them keeps exactly the columns it always had.
"""

from __future__ import annotations

import csv
import io
import math
import os
import pathlib
from dataclasses import dataclass, fields
from typing import Any

from gpuhit.errors import ConfigError


@dataclass(slots=True)
class RequestRecord:
    """What happened to one turn. Times are seconds on the replay clock (virtual or loop time).

    ``realized_hit_tokens`` = prompt tokens the engine did not compute (local GPU prefix cache plus
    tokens imported from a CPU/remote tier or a KV transfer). ``implied_hit_tokens`` = the upper bound
    the trace implies: the longest prefix of the turn's trace blocks already sent earlier in the same
    hash namespace (an infinite, shared prefix cache would serve exactly those tokens).
    ``error`` is empty for a request that finished normally. ``rejected`` is 1 when the request was
    refused before it ran (vLLM's 4xx: e.g. a prompt of >= max_model_len tokens), 0 otherwise; an
    ``error`` with ``rejected`` 0 is a failure after acceptance. ``note`` says what was sent differently
    from the trace (e.g. ``max_tokens 1: trace output 0``, since vLLM refuses ``max_tokens`` 0).
    ``preemptions``: how often the engine preempted the request (0 where the engine does not say).
    """

    run_id: str = ""
    policy: str = ""
    seed: int = 0
    session: str = ""
    parent_session: str = ""
    turn: int = 0
    instance: str = ""
    action: str = ""
    reason: str = ""
    arrival: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    input_tokens: int = 0
    output_tokens: int = 0
    predicted_hit_tokens: int = 0
    realized_hit_tokens: int = 0
    implied_hit_tokens: int = 0
    error: str = ""
    rejected: int = 0
    note: str = ""
    preemptions: int = 0  # times the engine preempted it (its KV freed, recomputed); simulated runs

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(slots=True)
class EngineTimedRecord(RequestRecord):
    """A record with the engine's own timing of the request, beside the client's.

    The client sees send, first token and finish; the engine sees its own part: ``engine_arrival``
    (when its API server took the request, on the replay clock), ``engine_queue`` (waiting to be
    scheduled), ``engine_prefill`` (first scheduled to first token), ``engine_decode`` (first to
    last token), ``engine_ttft`` and ``engine_e2e`` (from its arrival). These are vLLM's
    ``gen_ai.latency.*`` span attributes of the request, or the emulator's same timestamps. What the
    client saw beyond ``engine_e2e`` is the path (replayer, gateway, HTTP) before and after the engine.
    ``trace_id`` joins a live request to its engine span; ``engine_missing`` says why a request has
    no engine timing (e.g. no span arrived for it), never left empty silently.
    A subclass, not more fields of :class:`RequestRecord`, so that runs that do not ask for these
    columns keep exactly the records (and files) they had.
    """

    trace_id: str = ""
    engine_arrival: float = math.nan
    engine_queue: float = math.nan
    engine_prefill: float = math.nan
    engine_decode: float = math.nan
    engine_ttft: float = math.nan
    engine_e2e: float = math.nan
    engine_missing: str = ""


COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(RequestRecord))
ENGINE_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(EngineTimedRecord))[len(COLUMNS):]
TIMED_COLUMNS: tuple[str, ...] = COLUMNS + ENGINE_COLUMNS
ENGINE_TIMES: tuple[str, ...] = ("engine_arrival", "engine_queue", "engine_prefill", "engine_decode", "engine_ttft",
                                 "engine_e2e")
# what a plain RequestRecord written into a file with engine columns has there
_ABSENT = {c: (math.nan if c in ENGINE_TIMES else "") for c in ENGINE_COLUMNS}
_INT_COLUMNS = frozenset(
    {"seed", "turn", "input_tokens", "output_tokens", "predicted_hit_tokens", "realized_hit_tokens",
     "implied_hit_tokens", "rejected", "preemptions"}
)
_FLOAT_COLUMNS = frozenset({"arrival", "first_token", "finish", *ENGINE_TIMES})


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(value)
    return str(value)


def record_to_row(rec: RequestRecord, columns: tuple[str, ...] = COLUMNS) -> list[str]:
    """The CSV cells of ``rec`` in ``columns`` (engine columns of a plain record are empty)."""
    if columns is COLUMNS:
        return [_fmt(getattr(rec, c)) for c in COLUMNS]
    return [_fmt(getattr(rec, c, _ABSENT.get(c))) for c in columns]


def row_to_record(row: dict[str, str]) -> RequestRecord:
    """The record of one CSV row: an :class:`EngineTimedRecord` when the row has engine columns."""
    timed = "trace_id" in row
    kw: dict[str, object] = {}
    for c in TIMED_COLUMNS if timed else COLUMNS:
        v = row.get(c, "")
        if c in _INT_COLUMNS:
            kw[c] = int(v) if v != "" else 0
        elif c in _FLOAT_COLUMNS:
            kw[c] = float(v) if v != "" else math.nan
        else:
            kw[c] = v or ""
    return (EngineTimedRecord if timed else RequestRecord)(**kw)  # type: ignore[arg-type]


class RecordWriter:
    """Append-only CSV writer of :class:`RequestRecord` rows, flushed per row, resumable.

    ``policy``/``seed`` (optional) guard against resuming into a file that holds another run.
    ``engine_columns``: a new file gets :data:`ENGINE_COLUMNS` too (a resumed file keeps its own).
    Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], *, resume: bool = True,
                 policy: str | None = None, seed: int | None = None, engine_columns: bool = False):
        self.path = pathlib.Path(path)
        if self.path.suffix.lower() == ".parquet":
            raise ConfigError("records are written as CSV (append-only); convert with to_parquet() afterwards")
        self.done: set[tuple[str, int]] = set()
        self.resumed_rows = 0
        self._columns: tuple[str, ...] = TIMED_COLUMNS if engine_columns else COLUMNS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and not resume:
            raise ConfigError(f"{self.path} exists; remove it or resume into it")
        if exists:
            self._load_existing(policy, seed)
            self._fh = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 - held until close()
        else:
            self._fh = open(self.path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - held until close()
            self._fh.write(",".join(self._columns) + "\n")
            self._fh.flush()
        self._csv = csv.writer(self._fh, lineterminator="\n")

    def _load_existing(self, policy: str | None, seed: int | None) -> None:
        data = self.path.read_bytes()
        if not data.endswith(b"\n"):
            # Torn last row from a crash mid-write: drop it so the file stays parseable; that turn
            # has no complete row, so it is sent again.
            cut = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as fh:
                fh.truncate(cut)
            data = data[:cut]
        reader = csv.DictReader(io.StringIO(data.decode("utf-8")))
        cols = tuple(reader.fieldnames or ())
        # A file written before later columns were added (e.g. ``preemptions``) has a prefix of
        # COLUMNS: resumed rows keep the file's own columns so it stays one consistent CSV.
        if not cols or (COLUMNS[: len(cols)] != cols and cols != TIMED_COLUMNS) or "note" not in cols:
            raise ConfigError(f"{self.path} is not a gpuhit records file (columns {reader.fieldnames})")
        self._columns = cols
        for row in reader:
            if policy is not None and row["policy"] != policy:
                raise ConfigError(f"{self.path} holds a run of policy {row['policy']!r}, not {policy!r}")
            if seed is not None and row["seed"] != str(seed):
                raise ConfigError(f"{self.path} holds a run with seed {row['seed']}, not {seed}")
            self.done.add((row["session"], int(row["turn"])))
            self.resumed_rows += 1

    def write(self, rec: RequestRecord) -> None:
        self._csv.writerow(record_to_row(rec, self._columns))
        self._fh.flush()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> RecordWriter:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rewrite_records(path: str | os.PathLike[str], records: list[RequestRecord], columns: tuple[str, ...]) -> None:
    """Replace a finished records file by ``records`` in ``columns`` (written aside, then renamed: a
    crash leaves the old file whole). For columns known only after the run (engine spans)."""
    p = pathlib.Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as fh:
        fh.write(",".join(columns) + "\n")
        w = csv.writer(fh, lineterminator="\n")
        for rec in records:
            w.writerow(record_to_row(rec, columns))
    os.replace(tmp, p)


def records_to_frame(records: list[RequestRecord]):
    """A pandas DataFrame with one column per record field (in :data:`COLUMNS` order, then
    :data:`ENGINE_COLUMNS` when any record carries them)."""
    import pandas as pd

    cols = TIMED_COLUMNS if any(isinstance(r, EngineTimedRecord) for r in records) else COLUMNS
    return pd.DataFrame({c: [getattr(r, c, _ABSENT.get(c)) for r in records] for c in cols}, columns=list(cols))


def answered_by_turn(df: Any) -> Any:
    """The answered requests of a records frame, indexed by ``session#turn``: how a request is paired
    with itself in another run of the same seed (simulated against live)."""
    ok = df[df["error"].astype(str) == ""].copy()
    ok.index = ok["session"].astype(str) + "#" + ok["turn"].astype(str)
    return ok


def read_records(path: str | os.PathLike[str]):
    """Read a records CSV (or Parquet when pyarrow is installed) into a pandas DataFrame."""
    import pandas as pd

    p = pathlib.Path(path)
    if p.suffix.lower() == ".parquet":
        return pd.read_parquet(p)
    dtypes = {c: "int64" for c in _INT_COLUMNS} | {c: "float64" for c in _FLOAT_COLUMNS}
    dtypes |= {c: "string" for c in TIMED_COLUMNS if c not in dtypes}
    df = pd.read_csv(p, dtype=dtypes, keep_default_na=False, na_values={c: [""] for c in _FLOAT_COLUMNS})
    for c in TIMED_COLUMNS if "trace_id" in df.columns else COLUMNS:
        if c not in dtypes or dtypes[c] == "string":
            df[c] = df[c].fillna("").astype(object)
    return df


def to_parquet(csv_path: str | os.PathLike[str], parquet_path: str | os.PathLike[str]) -> None:
    """Convert a finished records CSV to Parquet; needs pyarrow (not a core dependency)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        from gpuhit.errors import UnavailableError

        raise UnavailableError("Parquet output needs pyarrow (pip install pyarrow); CSV is the default") from None
    read_records(csv_path).to_parquet(parquet_path, index=False)
