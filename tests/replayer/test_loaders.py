"""Loaders on the bundled real traces, on handmade fixtures, and on malformed input."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from gpuhit.errors import ConfigError, TraceFormatError
from replayer.loaders import bundled_path, detect_format, infer_sessions, load_trace, write_native
from replayer.trace import Session, Trace, Turn

BAILIAN_LINES = [
    # chat 1 is a root; 2 continues it; 3 continues 2; 4 is a new root; 5's parent (99) is not in the file
    {
        "chat_id": 1,
        "parent_chat_id": -1,
        "timestamp": 10.5,
        "input_length": 40,
        "output_length": 7,
        "type": "text",
        "turn": 1,
        "hash_ids": [1, 2, 3],
    },
    {
        "chat_id": 4,
        "parent_chat_id": -1,
        "timestamp": 11.0,
        "input_length": 16,
        "output_length": 3,
        "type": "text",
        "turn": 1,
        "hash_ids": [9],
    },
    {
        "chat_id": 2,
        "parent_chat_id": 1,
        "timestamp": 12.25,
        "input_length": 70,
        "output_length": 5,
        "type": "text",
        "turn": 2,
        "hash_ids": [1, 2, 4, 5, 6],
    },
    {
        "chat_id": 5,
        "parent_chat_id": 99,
        "timestamp": 13.0,
        "input_length": 17,
        "output_length": 1,
        "type": "text",
        "turn": 3,
        "hash_ids": [7, 8],
    },
    {
        "chat_id": 3,
        "parent_chat_id": 2,
        "timestamp": 20.0,
        "input_length": 96,
        "output_length": 2,
        "type": "image",
        "turn": 3,
        "hash_ids": [1, 2, 4, 5, 10, 11],
    },
]


def _write_lines(path: Path, records: list, gz: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    else:
        path.write_text(text)
    return path


# ------------------------------------------------------------------ WEKA


def test_weka_bundled_folder_shape():
    res = load_trace(bundled_path("weka"))
    t = res.trace
    assert (t.format, t.hash_scope, res.skipped) == ("weka", "local", 0)
    assert len(t.source) == 20
    roots = [s for s in t.sessions if s.parent is None]
    subs = [s for s in t.sessions if s.parent is not None]
    assert (len(roots), len(subs), t.num_requests) == (20, 19, 2357)
    # every turn's ids cover the full 64-token blocks of its prompt (WEKA gives ids for full blocks only)
    assert all(len(u.hash_ids) == u.input_length // 64 for s in t.sessions for u in s.turns)


def test_weka_conversation_and_subagents(tmp_path):
    t = load_trace(bundled_path("weka") / "trace_0004.json.gz").trace
    assert [s.session_id for s in t.sessions] == [
        "trace_0004",
        "trace_0004/agent_001",
        "trace_0004/agent_002",
    ]
    root, a1, a2 = t.sessions
    assert (root.namespace, root.block_size, root.system_tokens, root.arrival) == (
        "trace_0004",
        64,
        2979,
        0.0,
    )
    assert root.model == "claude-opus-4-5-20251101" and len(root.turns) == 182
    first, second = root.turns[:2]
    assert (first.input_length, first.output_length, len(first.hash_ids), first.hash_ids[:3]) == (
        84352,
        154,
        1318,
        (1, 2, 3),
    )
    assert (first.think_time, first.offset, second.think_time, second.offset) == (0.0, 0.0, 35.0, 51.0)
    # sub-agents: same namespace (ids are per conversation), parent set, start at their t
    assert (a1.parent, a1.namespace, a1.arrival, a1.system_tokens) == (
        "trace_0004",
        "trace_0004",
        440243.409,
        952,
    )
    assert a1.model == "claude-haiku-4-5-20251001" and len(a1.turns) == 14
    assert (a1.turns[0].offset, a1.turns[1].offset, a1.turns[1].think_time) == (0.0, 5.0, 3.0)
    assert (a2.arrival, len(a2.turns)) == (440281.797, 19)


def test_weka_think_time_inferred_when_missing(tmp_path):
    doc = {
        "id": "conv",
        "block_size": 64,
        "system_tokens": 10,
        "requests": [
            {"t": 0.0, "type": "n", "model": "m", "in": 64, "out": 5, "hash_ids": [1], "api_time": 2.5},
            {"t": 10.0, "type": "n", "model": "m", "in": 130, "out": 5, "hash_ids": [1, 2], "api_time": 1.0},
            {"t": 12.0, "type": "n", "model": "m", "in": 130, "out": 5, "hash_ids": [1, 2]},
            {
                "t": 20.0,
                "type": "n",
                "model": "m",
                "in": 130,
                "out": 5,
                "hash_ids": [1, 2],
                "think_time": 4.0,
            },
        ],
    }
    p = tmp_path / "conv.json"
    p.write_text(json.dumps(doc, indent=2))  # pretty-printed: detection must not need line 1 to be whole
    assert detect_format(p) == "weka"
    (s,) = load_trace(p).trace.sessions
    # end of turn k-1 (t + api_time) to t of turn k; without api_time, the send gap; recorded value wins
    assert [u.think_time for u in s.turns] == [0.0, 7.5, 1.0, 4.0]


# ------------------------------------------------------------------ Mooncake


def test_mooncake_bundled_inferred_sessions():
    res = load_trace(bundled_path("mooncake"))
    t = res.trace
    assert (t.format, t.hash_scope, res.skipped, t.num_requests) == ("mooncake", "global", 0, 12031)
    assert len(t.sessions) == 8057
    assert sum(len(s.turns) > 1 for s in t.sessions) == 2012
    s0 = t.sessions[0]
    assert (s0.session_id, s0.namespace, s0.block_size, s0.arrival) == (
        "conversation_trace#0",
        "conversation_trace",
        512,
        0.0,
    )
    assert s0.turns[0].hash_ids[:3] == (0, 1, 2) and s0.turns[0].input_length == 6758
    # within an inferred session, offsets are send times from its first request, think = send gap
    multi = next(s for s in t.sessions if len(s.turns) > 2)
    gaps = [b.offset - a.offset for a, b in zip(multi.turns, multi.turns[1:])]
    assert [u.think_time for u in multi.turns[1:]] == pytest.approx(gaps)
    assert all(g >= 0 for g in gaps)


def test_mooncake_without_inference_one_session_per_request():
    t = load_trace(bundled_path("mooncake"), infer_sessions=False).trace
    assert len(t.sessions) == 12031 and all(len(s.turns) == 1 for s in t.sessions)


def test_infer_sessions_rule():
    reqs = [
        (0, 1, 2),  # A
        (0, 5, 6),  # B
        (0, 1, 2, 3),  # extends A's full blocks (0, 1) -> A
        (0, 1, 7),  # shares (0, 1) with A's first turn -> A (branch from an earlier turn)
        (0, 8),  # shares only block 0 -> new
        (0, 5, 6, 9, 10),  # B's full part is (0, 5) -> B
        (0, 1, 2, 3, 4),  # A's third turn full part (0, 1, 2) is the longest match -> A
    ]
    assert infer_sessions(reqs) == [[0, 2, 3, 6], [1, 5], [4]]


# ------------------------------------------------------------------ Bailian, Azure


def test_bailian_sessions_from_parent_links(tmp_path):
    p = _write_lines(tmp_path / "qwen_trace.jsonl.gz", BAILIAN_LINES, gz=True)
    assert detect_format(p) == "bailian"
    t = load_trace(p).trace
    assert (t.format, t.hash_scope) == ("bailian", "global")
    by_id = {s.session_id: s for s in t.sessions}
    assert list(by_id) == ["qwen_trace#1", "qwen_trace#4", "qwen_trace#5"]
    s1 = by_id["qwen_trace#1"]
    assert (s1.block_size, s1.arrival, s1.namespace) == (16, 10.5, "qwen_trace")
    assert [u.input_length for u in s1.turns] == [40, 70, 96]
    assert [u.offset for u in s1.turns] == [0.0, 1.75, 9.5]
    assert [u.think_time for u in s1.turns] == [0.0, 1.75, 7.75]
    assert s1.turns[2].hash_ids == (1, 2, 4, 5, 10, 11)


def test_azure_bundled_head():
    t = load_trace(bundled_path("azure")).trace
    assert (t.format, t.hash_scope, len(t.sessions)) == ("azure", "none", 200)
    s0, s1 = t.sessions[:2]
    assert (s0.arrival, s0.turns[0].input_length, s0.turns[0].output_length, s0.turns[0].hash_ids) == (
        0.0,
        374,
        44,
        (),
    )
    # 18:15:46.6805900 -> 18:15:50.9951690: fractions with 7 digits are kept exactly
    assert s1.arrival == pytest.approx(4.314579, abs=1e-9)


def test_azure_csv_fixture_from_shared(shared_traces, tmp_path):
    lines = (shared_traces / "azure" / "AzureLLMInferenceTrace_code.csv").read_text().splitlines()[:6]
    p = tmp_path / "code.csv"
    p.write_text("\n".join(lines) + "\n")
    t = load_trace(p).trace
    assert [s.turns[0].input_length for s in t.sessions] == [int(x.split(",")[1]) for x in lines[1:]]


# ------------------------------------------------------------------ native round trip


def _roundtrip(trace: Trace, tmp_path: Path, name: str) -> Trace:
    out = tmp_path / name
    write_native(trace, out)
    assert detect_format(out) == "native"
    res = load_trace(out)
    assert res.skipped == 0
    return res.trace


@pytest.mark.parametrize("which", ["weka", "mooncake", "azure"])
def test_native_roundtrip_bundled(which, tmp_path):
    trace = load_trace(bundled_path(which)).trace
    assert _roundtrip(trace, tmp_path, "t.jsonl.gz") == trace


def test_native_roundtrip_every_field(tmp_path):
    trace = Trace(
        name="handmade",
        format="bailian",
        hash_scope="global",
        source=("a.jsonl", "b.jsonl"),
        sessions=(
            Session(
                "s1",
                (Turn(33, 4, (7, 8, 9), 0.0, 0.0, "m1"), Turn(50, 1, (7, 8, 9, 10), 0.1 + 0.2, 1 / 3, "m2")),
                16,
                "ns",
                1e-9,
                None,
                "m1",
                12,
            ),
            Session("s1/child", (Turn(0, 0, (), 0.0, 0.0),), 64, "ns", 2.5, "s1", "", 0),
        ),
    )
    for name in ("t.jsonl", "t.jsonl.gz"):
        assert _roundtrip(trace, tmp_path, name) == trace


# ------------------------------------------------------------------ detection


def test_detection_by_content_not_name(tmp_path):
    moon = _write_lines(
        tmp_path / "data.csv", [{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}]
    )
    assert detect_format(moon) == "mooncake"
    az = tmp_path / "x.jsonl"
    az.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    assert detect_format(az) == "azure"
    gz = tmp_path / "plain_name.json"  # gzip content under a plain name
    gz.write_bytes((bundled_path("weka") / "trace_0032.json.gz").read_bytes())
    assert detect_format(gz) == "weka"
    assert load_trace(gz).trace.sessions[0].session_id == "trace_0032"
    with pytest.raises(TraceFormatError, match="cannot tell the trace format"):
        detect_format(_write_lines(tmp_path / "what.jsonl", [{"hello": 1}]))
    assert detect_format(bundled_path("weka") / "trace_0032.json.gz") == "weka"


def test_format_override_and_errors(tmp_path):
    p = _write_lines(tmp_path / "q.jsonl", BAILIAN_LINES)
    with pytest.raises(ConfigError, match="unknown trace format"):
        load_trace(p, fmt="nope")
    # forcing mooncake on bailian data: valid mooncake shape, but ids at block 16 do not cover at 512
    res = load_trace(p, fmt="mooncake")
    assert res.skipped == 4 and "do not cover input_length" in res.problems[0]  # [9] covers 16 tokens
    with pytest.raises(TraceFormatError, match="mixed trace formats"):
        load_trace([p, bundled_path("azure")])
    with pytest.raises(TraceFormatError, match="occurs twice"):
        load_trace([p, p])
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "missing.jsonl")


def test_bundled_path_unknown():
    with pytest.raises(ConfigError, match="unknown bundled trace"):
        bundled_path("nope")
    assert bundled_path("mooncake").name == "conversation_trace.jsonl.gz"


# ------------------------------------------------------------------ malformed input

GOOD = {"timestamp": 1000, "input_length": 1000, "output_length": 3, "hash_ids": [0, 1]}
BAD_RECORDS = [
    ('{"timestamp": 1, "input_length": 5', "bad JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({**GOOD, "input_length": -5}, "negative input_length -5"),
    ({**GOOD, "output_length": "12"}, "output_length must be a non-negative integer"),
    ({**GOOD, "input_length": 1.5}, "input_length must be a non-negative integer"),
    (
        {**GOOD, "hash_ids": [0, 1, 2]},
        "3 hash_ids do not cover input_length 1000 at block size 512 (expected 1 or 2)",
    ),
    ({**GOOD, "hash_ids": [0, "x"]}, "hash_ids must be integers"),
    ({**GOOD, "hash_ids": [0, 1.0]}, "hash_ids must be integers"),
    ({**GOOD, "hash_ids": "0,1"}, "hash_ids must be a list"),
    ({**GOOD, "timestamp": -1}, "timestamp must be a non-negative number"),
]


@pytest.mark.parametrize("record,reason", BAD_RECORDS)
def test_bad_record_strict_raises_with_file_and_line(record, reason, tmp_path):
    p = _write_lines(tmp_path / "m.jsonl", [GOOD, record, GOOD])
    with pytest.raises(TraceFormatError) as err:
        load_trace(p, fmt="mooncake", strict=True)
    assert (err.value.path, err.value.line) == (str(p), 2)
    assert reason in err.value.reason
    assert str(err.value).startswith(f"{p}:2: ")


def test_bad_records_skipped_and_counted(tmp_path):
    records = [GOOD] + [r for r, _ in BAD_RECORDS] + [GOOD]
    p = _write_lines(tmp_path / "m.jsonl.gz", records, gz=True)
    res = load_trace(p, fmt="mooncake")
    assert res.skipped == len(BAD_RECORDS) and res.trace.num_requests == 2
    assert [m.split(": ", 1)[0] for m in res.problems] == [f"{p}:{i}" for i in range(2, 2 + len(BAD_RECORDS))]
    for msg, (_, reason) in zip(res.problems, BAD_RECORDS):
        assert reason in msg


def test_weka_bad_requests(tmp_path):
    doc = {
        "id": "c",
        "block_size": 64,
        "requests": [
            {"t": 0.0, "type": "n", "in": 128, "out": 1, "hash_ids": [1, 2]},
            {"t": 1.0, "type": "n", "in": -1, "out": 1, "hash_ids": []},
            {"t": 2.0, "type": "n", "in": 200, "out": 1, "hash_ids": [1, 2]},
            {
                "t": 3.0,
                "type": "subagent",
                "agent_id": "a",
                "requests": [{"t": "x", "in": 1, "out": 1, "hash_ids": []}],
            },
            {"t": 4.0, "type": "n", "in": 192, "out": 1, "hash_ids": [1, 2, 3]},
        ],
    }
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    res = load_trace(p)
    assert res.skipped == 3
    assert res.problems == [
        f"{p}: requests[1]: negative input length 'in' -1",
        f"{p}: requests[2]: 2 hash_ids do not cover input_length 200 at block size 64 (expected 3 or 4)",
        f"{p}: requests[3].requests[0]: 't' must be a non-negative number, got 'x'",
    ]
    (s,) = res.trace.sessions
    assert [u.offset for u in s.turns] == [0.0, 4.0]
    with pytest.raises(TraceFormatError, match=r"requests\[1\]: negative input length"):
        load_trace(p, strict=True)
    p.write_text("{not json")
    with pytest.raises(TraceFormatError, match=r"c.json:1: bad JSON"):
        load_trace(p, fmt="weka", strict=True)


def test_azure_bad_lines(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.0,x,44\n"
        "yesterday,1,1\n"
        "2023-11-16 18:15:48.0,1\n"
        "2023-11-16 18:15:49.0,-3,1\n"
        "2023-11-16 18:15:50.0,10,1\n"
    )
    res = load_trace(p)
    assert res.skipped == 4 and len(res.trace.sessions) == 2
    assert [m.split(": ", 1)[0] for m in res.problems] == [f"{p}:{i}" for i in (3, 4, 5, 6)]


def test_native_bad_header_and_session(tmp_path):
    p = tmp_path / "n.jsonl"
    p.write_text('{"gpuhit_trace": 99, "format": "weka", "hash_scope": "local", "source": []}\n')
    with pytest.raises(TraceFormatError, match="unsupported native trace version 99"):
        load_trace(p, fmt="native")
    p.write_text(
        '{"gpuhit_trace": 1, "name": "n", "format": "weka", "hash_scope": "local", "source": []}\n'
        '{"session_id": "a", "block_size": 64, "namespace": "a", "turns": [{"input_length": 64, "output_length": 1, "hash_ids": [5]}]}\n'
        '{"session_id": "b", "block_size": 64, "namespace": "b", "bogus": 1, "turns": []}\n'
        '{"session_id": "c", "block_size": 64, "namespace": "c", "turns": [{"input_length": 64, "output_length": 1, "hash_ids": [5, 6, 7]}]}\n'
    )
    res = load_trace(p)
    assert res.skipped == 2 and [s.session_id for s in res.trace.sessions] == ["a"]
    assert "unknown fields ['bogus']" in res.problems[0] and "3 hash_ids do not cover" in res.problems[1]
    assert res.trace.sessions[0].turns[0] == Turn(64, 1, (5,))


def test_problem_messages_are_capped_but_count_is_exact(tmp_path):
    p = _write_lines(tmp_path / "m.jsonl", [GOOD] + ["{"] * 50)
    res = load_trace(p, fmt="mooncake")
    assert res.skipped == 50 and len(res.problems) == 20


def test_ceil_or_floor_coverage_rule():
    # the rule the loaders apply: len(ids) in {floor, ceil}(input / bs)
    from replayer.loaders._common import check_hash_ids

    assert check_hash_ids([1, 2], 1000, 512, False) is None
    assert check_hash_ids([1], 1000, 512, False) is None
    assert check_hash_ids([1], 1024, 512, False) is not None
    assert check_hash_ids([], 0, 512, False) is None
    assert check_hash_ids([], 10, 512, True) is None
    assert math.ceil(1000 / 512) == 2
