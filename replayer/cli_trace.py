"""``gpuhit trace stats|convert``: inspect a trace and convert it to the native format."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from replayer.loaders import FORMATS, LoadResult, load_trace, write_native
from replayer.stats import TraceStats, trace_stats

T = TypeVar("T")
PROGRESS_AFTER_S = 2.0  # only slow loads talk on stderr
SHOWN_PROBLEMS = 5


def register(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser("trace", help="inspect and convert trace files")
    sub = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    trace.set_defaults(func=lambda args: (trace.print_help(), 2)[1])

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("files", nargs="+", metavar="FILE", help="trace files or folders (plain or .gz)")
        p.add_argument("--format", choices=FORMATS, default=None, help="force the format (default: detect)")
        p.add_argument("--strict", action="store_true", help="stop at the first bad record")
        p.add_argument(
            "--no-infer-sessions",
            dest="infer_sessions",
            action="store_false",
            help="Mooncake: one session per request instead of inferring sessions by hash-id prefixes",
        )

    stats = sub.add_parser("stats", help="print a trace's shape and implied KV reuse")
    common(stats)
    stats.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    stats.set_defaults(func=_stats)

    convert = sub.add_parser("convert", help="write a trace in gpuhit's native JSONL format")
    common(convert)
    convert.add_argument("-o", "--output", required=True, metavar="OUT.jsonl[.gz]", help="output file")
    convert.set_defaults(func=_convert)


def _with_progress(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn``; if it takes longer than PROGRESS_AFTER_S, say so on stderr (and when it ends)."""
    done = threading.Event()
    start = time.perf_counter()

    def notice() -> None:
        if not done.wait(PROGRESS_AFTER_S):
            print(f"gpuhit: {what} ...", file=sys.stderr, flush=True)

    watcher = threading.Thread(target=notice, daemon=True)
    watcher.start()
    try:
        return fn()
    finally:
        done.set()
        elapsed = time.perf_counter() - start
        if elapsed > PROGRESS_AFTER_S:
            print(f"gpuhit: {what}: {elapsed:.1f} s", file=sys.stderr, flush=True)


def _load(args: argparse.Namespace) -> LoadResult:
    result = _with_progress(
        "loading " + ", ".join(args.files),
        lambda: load_trace(
            args.files, fmt=args.format, strict=args.strict, infer_sessions=args.infer_sessions
        ),
    )
    if result.skipped:
        print(f"gpuhit: skipped {result.skipped} bad record(s); first problems:", file=sys.stderr)
        for msg in result.problems[:SHOWN_PROBLEMS]:
            print(f"  {msg}", file=sys.stderr)
    return result


def _stats(args: argparse.Namespace) -> int:
    result = _load(args)
    st = _with_progress("computing statistics", lambda: trace_stats(result.trace))
    if args.json:
        doc: dict[str, Any] = st.to_dict()
        doc["skipped_records"] = result.skipped
        doc["problems"] = result.problems
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_stats(st, result.skipped))
    return 0


def _convert(args: argparse.Namespace) -> int:
    result = _load(args)
    _with_progress(f"writing {args.output}", lambda: write_native(result.trace, args.output))
    t = result.trace
    print(
        f"wrote {args.output}: {len(t.sessions)} sessions, {t.num_requests} requests ({t.format} -> native)"
    )
    return 0


def format_stats(st: TraceStats, skipped: int = 0) -> str:
    """A readable table of :class:`TraceStats`."""

    def dist(d: Any, fmt: str = "{:,.0f}") -> str:
        return "  ".join(f"{k} {fmt.format(getattr(d, k))}" for k in ("mean", "p50", "p90", "p99", "max"))

    rows = [
        ("trace", f"{st.name} ({st.format})"),
        ("sessions", f"{st.sessions:,} ({st.root_sessions:,} root, {st.child_sessions:,} sub-agent)"),
        ("requests", f"{st.requests:,}"),
        ("span", f"{st.span_s:,.1f} s"),
        ("turns/session", dist(st.turns_per_session, "{:,.1f}")),
        (
            "multi-turn",
            (
                f"{st.multi_turn_sessions:,} sessions ({st.multi_turn_session_share:.1%}) "
                f"carrying {st.multi_turn_request_share:.1%} of requests"
            ),
        ),
        ("input tokens", dist(st.input_tokens)),
        ("output tokens", dist(st.output_tokens)),
        ("total tokens", f"input {st.total_input_tokens:,}  output {st.total_output_tokens:,}"),
    ]
    if st.input_blocks:
        rows += [
            ("input blocks", f"{st.input_blocks:,} (at the trace's block size)"),
            (
                "implied reuse",
                (
                    f"intra-session {st.reuse_intra_session:.1%}  cross-session {st.reuse_cross_session:.1%}  "
                    f"new {st.new_blocks:.1%}"
                ),
            ),
        ]
    else:
        rows.append(("implied reuse", "n/a (the trace has no hash ids)"))
    if skipped:
        rows.append(("skipped records", f"{skipped:,}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
