"""Trace loaders: WEKA, Mooncake, Qwen-Bailian, Azure and gpuhit's native JSONL, plain or gzip.

``load_trace(paths)`` reads files and folders into one immutable :class:`~replayer.trace.Trace`.
The format of each file is detected from its content (the first record), never from its name, and
can be forced with ``fmt``. A bad record (bad JSON, wrong types, a negative length, hash ids that do
not cover the input length at the format's block size) raises
:class:`~gpuhit.errors.TraceFormatError` with file:line and the reason when ``strict``; otherwise it
is skipped, counted in ``LoadResult.skipped`` and its message kept in ``LoadResult.problems``.
"""

from __future__ import annotations

import gc
import json
import re
from dataclasses import dataclass
from pathlib import Path

from gpuhit.errors import ConfigError, TraceFormatError
from replayer.loaders._common import Problems, open_text
from replayer.loaders.azure import load_azure
from replayer.loaders.jsonl import infer_sessions, load_bailian, load_mooncake, sniff_record
from replayer.loaders.native import load_native, write_native
from replayer.loaders.weka import load_weka
from replayer.trace import Session, Trace

__all__ = [
    "FORMATS",
    "LoadResult",
    "bundled_path",
    "detect_format",
    "infer_sessions",
    "list_trace_files",
    "load_trace",
    "write_native",
]

FORMATS = ("weka", "mooncake", "bailian", "azure", "native")
HASH_SCOPE = {"weka": "local", "mooncake": "global", "bailian": "global", "azure": "none"}
_DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".json.gz", ".jsonl.gz", ".csv.gz")
_SNIFF_CHARS = 8192

# Bundled slices shipped in the repository's traces/ folder (see traces/README.md).
BUNDLED = {
    "weka": "weka_cc",
    "mooncake": "mooncake/conversation_trace.jsonl.gz",
    "azure": "azure/azure_conv_head.csv",
}


@dataclass(frozen=True)
class LoadResult:
    trace: Trace
    skipped: int  # bad records skipped (0 when strict: strict raises instead)
    problems: list[str]  # the first "file:line: reason" messages


def bundled_path(name: str) -> Path:
    """Path of a trace bundled in the repository's ``traces/`` folder ("weka", "mooncake", "azure")."""
    try:
        rel = BUNDLED[name]
    except KeyError:
        raise ConfigError(f"unknown bundled trace {name!r}; choose one of {sorted(BUNDLED)}") from None
    # replayer/loaders/__init__.py -> repository root (the package is installed editable from it)
    path = Path(__file__).resolve().parents[2] / "traces" / rel
    if not path.exists():
        raise ConfigError(
            f"bundled trace {name!r} is missing: expected {path}. The bundled traces live in the "
            "repository's traces/ folder; run from a full checkout (pip install -e .) or pass a trace path."
        )
    return path


def list_trace_files(path: Path) -> list[Path]:
    """A file stands for itself; a folder for its data files (.json/.jsonl/.csv, optionally .gz), sorted."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_DATA_SUFFIXES))
        if not files:
            raise TraceFormatError(
                "folder holds no trace files (*.json, *.jsonl, *.csv, optionally .gz)", str(path)
            )
        return files
    if not path.exists():
        raise TraceFormatError("no such file or folder", str(path))
    return [path]


def detect_format(path: str | Path) -> str:
    """The format of one trace file, from the start of its content (gzip or plain)."""
    path = Path(path)
    try:
        with open_text(path) as fh:
            head = fh.read(_SNIFF_CHARS)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"cannot read trace file: {exc}", str(path)) from None
    text = head.lstrip("\ufeff \t\r\n")
    first_line = text.split("\n", 1)[0].strip()
    if first_line.replace(" ", "").upper().startswith("TIMESTAMP,CONTEXTTOKENS"):
        return "azure"
    if text.startswith("{"):
        rec = None
        if len(first_line) < len(text) or len(head) < _SNIFF_CHARS:  # the whole first line was read
            try:
                rec = json.loads(first_line)
            except json.JSONDecodeError:
                rec = None
        if isinstance(rec, dict) and "gpuhit_trace" in rec:
            return "native"
        fmt = sniff_record(rec)
        if fmt:
            return fmt
        # A WEKA conversation is one (possibly huge, possibly pretty-printed) JSON document.
        if re.search(r'"(requests|hash_id_scope)"\s*:', text):
            return "weka"
        if re.search(r'"gpuhit_trace"\s*:', first_line):
            return "native"
        if re.search(r'"chat_id"\s*:', first_line):
            return "bailian"
        if re.search(r'"input_length"\s*:', first_line):
            return "mooncake"
    raise TraceFormatError(
        "cannot tell the trace format from the content; pass --format (one of " + ", ".join(FORMATS) + ")",
        str(path),
    )


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json", ".csv"):
        name = name.removesuffix(suffix)
    return name


def load_trace(
    paths: str | Path | list[str | Path] | tuple[str | Path, ...],
    fmt: str | None = None,
    strict: bool = False,
    infer_sessions: bool = True,
) -> LoadResult:
    """Load trace files and folders into one :class:`Trace`.

    ``fmt`` forces the format (else detected per file; all files must agree). ``infer_sessions``
    applies to Mooncake only (its requests carry no session ids).
    """
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ConfigError("no trace file given")
    roots = [Path(p) for p in paths]
    files = [f for root in roots for f in list_trace_files(root)]
    # Loading allocates millions of containers and no reference cycles: the cyclic collector would
    # only rescan the growing heap again and again (~25% of a full WEKA folder's load time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _load_files(roots, files, fmt, strict, infer_sessions)
    finally:
        if gc_was_enabled:
            gc.enable()


def _load_files(
    roots: list[Path], files: list[Path], fmt: str | None, strict: bool, infer: bool
) -> LoadResult:
    problems = Problems(strict)
    sessions: list[Session] = []
    formats: set[str] = set()
    headers: list[dict] = []
    for f in files:
        kind = fmt or detect_format(f)
        formats.add(kind)
        if len(formats) > 1:
            raise TraceFormatError(
                f"mixed trace formats ({', '.join(sorted(formats))}); load one format at a time", str(f)
            )
        if kind == "weka":
            sessions.extend(load_weka(f, problems))
        elif kind == "mooncake":
            sessions.extend(load_mooncake(f, problems, infer))
        elif kind == "bailian":
            sessions.extend(load_bailian(f, problems))
        elif kind == "azure":
            sessions.extend(load_azure(f, problems))
        else:
            header, got = load_native(f, problems)
            headers.append(header)
            sessions.extend(got)
    seen: set[str] = set()
    for s in sessions:
        if s.session_id in seen:
            raise TraceFormatError(
                f"session id {s.session_id!r} occurs twice (the same conversation loaded twice?)",
                ", ".join(str(p) for p in roots),
            )
        seen.add(s.session_id)
    (kind,) = formats
    if kind == "native":
        if len(headers) == 1:
            h = headers[0]
            name, orig, scope, source = (
                h.get("name") or _stem(files[0]),
                h["format"],
                h["hash_scope"],
                tuple(h["source"]),
            )
        else:
            orig_formats = {h["format"] for h in headers}
            scopes = {h["hash_scope"] for h in headers}
            orig = orig_formats.pop() if len(orig_formats) == 1 else "native"
            scope = scopes.pop() if len(scopes) == 1 else "local"
            name = f"{_stem(roots[0])}+{len(files) - 1}"
            source = tuple(s for h in headers for s in h["source"])
    else:
        orig, scope, source = kind, HASH_SCOPE[kind], tuple(str(f) for f in files)
        name = _stem(roots[0]) if len(roots) == 1 else f"{_stem(roots[0])}+{len(roots) - 1}"
    trace = Trace(name=name, format=orig, sessions=tuple(sessions), hash_scope=scope, source=source)
    return LoadResult(trace=trace, skipped=problems.skipped, problems=list(problems.messages))
