"""Summary statistics of a trace: shape (sessions, turns, tokens, span) and the KV reuse it implies.

Implied reuse counts *input blocks* at the trace's own block size: a block ``(namespace, hash id)``
of a request is ``intra-session`` when an earlier request of the same session already had it,
``cross-session`` when only earlier requests of other sessions had it, and ``new`` otherwise
("earlier" = the order of recorded send times, ``arrival + offset``). Traces without hash ids
(Azure) report no reuse (all fractions 0, ``input_blocks`` 0).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from replayer.trace import Trace


@dataclass(frozen=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: np.ndarray) -> Distribution:
        if values.size == 0:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return cls(float(values.mean()), float(p50), float(p90), float(p99), float(values.max()))


@dataclass(frozen=True)
class TraceStats:
    name: str
    format: str
    sessions: int
    root_sessions: int
    child_sessions: int
    requests: int
    span_s: float  # first to last recorded send (0 when the trace has one request or no times)
    turns_per_session: Distribution
    input_tokens: Distribution
    output_tokens: Distribution
    total_input_tokens: int
    total_output_tokens: int
    multi_turn_sessions: int
    multi_turn_session_share: float  # of sessions
    multi_turn_request_share: float  # of requests, carried by multi-turn sessions
    input_blocks: int  # blocks with a hash id, at the trace's block size
    reuse_intra_session: float  # fraction of input_blocks
    reuse_cross_session: float
    new_blocks: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def trace_stats(trace: Trace) -> TraceStats:
    """Statistics of ``trace``; O(total hash ids) with one dict probe per block."""
    sessions = trace.sessions
    turns_per = np.fromiter((len(s.turns) for s in sessions), dtype=np.int64, count=len(sessions))
    n_req = int(turns_per.sum())
    ins = np.fromiter((t.input_length for s in sessions for t in s.turns), dtype=np.int64, count=n_req)
    outs = np.fromiter((t.output_length for s in sessions for t in s.turns), dtype=np.int64, count=n_req)
    sends = np.fromiter(
        (s.arrival + t.offset for s in sessions for t in s.turns), dtype=np.float64, count=n_req
    )
    span = float(sends.max() - sends.min()) if n_req else 0.0
    children = sum(1 for s in sessions if s.parent is not None)
    multi = turns_per > 1
    intra, cross, total = _reuse(trace, sends)
    return TraceStats(
        name=trace.name,
        format=trace.format,
        sessions=len(sessions),
        root_sessions=len(sessions) - children,
        child_sessions=children,
        requests=n_req,
        span_s=span,
        turns_per_session=Distribution.of(turns_per),
        input_tokens=Distribution.of(ins),
        output_tokens=Distribution.of(outs),
        total_input_tokens=int(ins.sum()),
        total_output_tokens=int(outs.sum()),
        multi_turn_sessions=int(multi.sum()),
        multi_turn_session_share=float(multi.mean()) if len(sessions) else 0.0,
        multi_turn_request_share=float(turns_per[multi].sum() / n_req) if n_req else 0.0,
        input_blocks=total,
        reuse_intra_session=intra / total if total else 0.0,
        reuse_cross_session=cross / total if total else 0.0,
        new_blocks=(total - intra - cross) / total if total else 0.0,
    )


def _reuse(trace: Trace, sends: np.ndarray) -> tuple[int, int, int]:
    """(intra-session, cross-session, total) block counts, requests visited in send order.

    A block is *new* at the first occurrence of its (namespace, id), *intra-session* when not the
    first occurrence of its (session, id) (a session has one namespace), else *cross-session*.
    Shortcut: the leading ids a turn shares with its session's previous turn occurred earlier in
    that session, so they are intra-session without looking; only the rest (a few percent for
    agentic traces) goes through the vectorized first-occurrence test (``np.unique``).
    """
    sessions = trace.sessions
    order = np.argsort(sends, kind="stable").tolist()  # stable: file order on equal send times
    where = [(i, t) for i, s in enumerate(sessions) for t in s.turns]
    previous: dict[int, tuple[int, ...]] = {}
    rest: list[tuple[int, ...]] = []
    rest_session: list[int] = []
    total = intra_prefix = 0
    for j in order:
        i, turn = where[j]
        ids = turn.hash_ids
        total += len(ids)
        c = _common_prefix(previous.get(i, ()), ids)
        previous[i] = ids
        intra_prefix += c
        if c < len(ids):
            rest.append(ids[c:] if c else ids)
            rest_session.append(i)
    if total == 0:
        return 0, 0, 0
    lengths = np.fromiter((len(r) for r in rest), dtype=np.int64, count=len(rest))
    n = int(lengths.sum())
    if n == 0:
        return intra_prefix, 0, total
    try:
        ids_arr = np.fromiter(itertools.chain.from_iterable(rest), dtype=np.int64, count=n)
    except OverflowError:  # ids beyond int64 (possible in native files): densify in Python first
        dense: dict[int, int] = {}
        ids_arr = np.fromiter(
            (dense.setdefault(h, len(dense)) for r in rest for h in r), dtype=np.int64, count=n
        )
    ns_index: dict[str, int] = {}
    sess_ns = np.fromiter((ns_index.setdefault(s.namespace, len(ns_index)) for s in sessions), dtype=np.int64)
    block_session = np.repeat(np.asarray(rest_session, dtype=np.int64), lengths)
    lo, hi = int(ids_arr.min()), int(ids_arr.max())
    if lo >= 0 and (hi + 1) * (len(sessions) + 1) < 2**62:
        dense_ids, u = ids_arr, np.int64(hi + 1)  # already small non-negative ints: no need to densify
    else:
        uniq, dense_ids = np.unique(ids_arr, return_inverse=True)
        u = np.int64(uniq.size)
    first_ns = _first_occurrence(sess_ns[block_session] * u + dense_ids)
    first_sess = _first_occurrence(block_session * u + dense_ids)
    intra = intra_prefix + int(n - first_sess.sum())
    cross = int((first_sess & ~first_ns).sum())
    return intra, cross, total


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the common prefix of two id tuples; C-speed slice compares, O(log n) of them."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if a[:n] == b[:n]:
        return n
    if n > 1 and a[: n - 1] == b[: n - 1]:  # the usual agentic turn: all but the last (partial) block
        return n - 1
    lo, hi = 0, n - 1  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _first_occurrence(keys: np.ndarray) -> np.ndarray:
    """Boolean mask: True where ``keys[i]`` occurs for the first time."""
    _, first = np.unique(keys, return_index=True)
    mask = np.zeros(keys.size, dtype=bool)
    mask[first] = True
    return mask
