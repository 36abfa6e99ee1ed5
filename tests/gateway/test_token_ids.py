"""The token-id stage (gateway/http/token_ids.py): the C parser (gpuhit/_tokenids.c) against the numpy
reference on generated arrays, well-formed and not. The two must give the same ids or both refuse
(the C parser never gives an id the reference would not), the reference's ids must be what a JSON
parser reads, and every array the C parser refuses is counted as a fallback."""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http.prompt import FAST_PARSE_MIN_BYTES, fast_completion_ids
from gateway.http.token_ids import TokenIdParser, parse_ids

WS = st.sampled_from(["", "", "", " ", "\n", "\t", "\r", "  "])
IDS = st.lists(st.one_of(st.integers(0, 150_000), st.integers(0, 10**18 - 1), st.integers(0, 9)),
               min_size=1, max_size=300)


@st.composite
def arrays(draw) -> bytes:
    """The text between a JSON array's brackets: valid ids with random JSON whitespace."""
    ids = draw(IDS)
    parts = [draw(WS) + str(i) + draw(WS) for i in ids]
    return ",".join(parts).encode()


# Bytes that break the language in every way it can break: signs, fractions, exponents, other
# whitespace, brackets, letters, a non-ASCII byte.
JUNK = st.sampled_from([b"-", b"+", b".", b"e", b"E", b"\x0b", b"\x0c", b"[", b"]", b"a", b",", b" ", b"0", b"00",
                        b"\xc3\xa9", b"1" * 19, b"\x00"])


@st.composite
def mangled(draw) -> bytes:
    """A valid array's text with a few bytes inserted, replaced or removed."""
    text = bytearray(draw(arrays()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "replace", "delete"]))
        junk = draw(JUNK)
        if op == "insert":
            text[at:at] = junk
        elif op == "replace":
            text[at:at + len(junk)] = junk
        else:
            del text[at:at + 1]
    return bytes(text)


def _json_ids(text: bytes) -> list[int] | None:
    """What a JSON parser reads from the array, when it is a list of plain ints of at most 18 digits."""
    try:
        doc = json.loads(b"[" + text + b"]")
    except ValueError:
        return None
    if not all(type(v) is int and 0 <= v < 10**18 for v in doc) or not doc:
        return None
    return doc


def _both(c_speedups, text: bytes, pad: bytes = b"xx") -> tuple[np.ndarray | None, np.ndarray | None, int]:
    """(C ids, reference ids, C fallbacks) of ``text`` inside a larger buffer (so the parsers read
    only their range)."""
    raw = pad + text + pad
    c = TokenIdParser(c_speedups)
    fast = c.parse(raw, len(pad), len(pad) + len(text))
    ref = parse_ids(raw, len(pad), len(pad) + len(text))
    return fast, ref, c.fallbacks


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(text=arrays())
def test_the_c_parser_reads_valid_arrays_as_the_reference_and_json_do(c_speedups, text):
    fast, ref, fallbacks = _both(c_speedups, text)
    want = _json_ids(text)
    assert want is not None and ref is not None and fast is not None and fallbacks == 0
    assert fast.dtype == np.uint64 and fast.tolist() == ref.tolist() == want


@SETTINGS
@given(text=mangled())
def test_the_c_parser_refuses_what_the_reference_refuses_and_never_gives_a_wrong_id(c_speedups, text):
    fast, ref, fallbacks = _both(c_speedups, text)
    raw_c = c_speedups.parse_uint_array(text, 0, len(text))
    assert (raw_c is None) == (parse_ids(text, 0, len(text)) is None)
    if ref is None:
        assert fast is None and fallbacks == 1  # refused by both: counted, and the whole-body parse decides
    else:
        assert fast is not None and fast.tolist() == ref.tolist() == _json_ids(text)


@pytest.mark.parametrize("text", [b"", b" ", b",", b"1,", b",1", b"1,,2", b"01", b"1 2", b"-1", b"1.0", b"1e3",
                                  b"1" * 19, b"18446744073709551615", b"1\x0b", b"[1]", b"\xff"])
def test_edge_cases_both_refuse(c_speedups, text):
    fast, ref, fallbacks = _both(c_speedups, text)
    assert fast is None and ref is None and fallbacks == 1


@pytest.mark.parametrize("text", [b"0", b"0,0", b"9" * 18, b" 1 , 2 ", b"\t7\n", b"1,2,3" * 40,
                                  ("1234567," * 30 + "0").encode(), (",".join(["12345678"] * 40)).encode()])
def test_edge_cases_both_read(c_speedups, text):
    fast, ref, fallbacks = _both(c_speedups, text)
    assert fast is not None and fast.tolist() == ref.tolist() == _json_ids(text) and fallbacks == 0


def test_a_body_reads_the_same_through_either_stage(c_speedups):
    """fast_completion_ids with the C stage and the reference: the same body and ids, eager or lazy,
    and the same refusal (None: the whole-body parse decides) for a body outside the language."""
    ids = list(range(100_000, 100_000 + FAST_PARSE_MIN_BYTES))
    raw = orjson.dumps({"model": "m", "prompt": ids, "max_tokens": 3})
    for session in (None, "s"):
        c_body, c_ids = fast_completion_ids(raw, None, session, TokenIdParser(c_speedups))
        r_body, r_ids = fast_completion_ids(raw, None, session)
        assert c_body == r_body == {"model": "m", "max_tokens": 3}
        assert np.asarray(c_ids).tolist() == np.asarray(r_ids).tolist() == ids
    bad = raw.replace(b"100007,", b"-100007,")
    parser = TokenIdParser(c_speedups)
    assert fast_completion_ids(bad, None, None, parser) is None and fast_completion_ids(bad) is None
    assert parser.fallbacks == 1


def test_the_prompt_memo_extends_through_either_stage(c_speedups):
    """A session's next turn (the previous prompt plus new ids) parses only its new ids, with the C
    stage as with the reference, to the same ids."""
    from gateway.http.prompt import PromptMemo

    first = list(range(5_000, 5_000 + FAST_PARSE_MIN_BYTES))
    second = first + list(range(7, 700))
    got = {}
    for name, parser in (("c", TokenIdParser(c_speedups)), ("reference", TokenIdParser())):
        memo = PromptMemo()
        for ids in (first, second):
            raw = orjson.dumps({"model": "m", "prompt": ids})
            _, parsed = fast_completion_ids(raw, memo, "s", parser)
            got[name] = np.asarray(parsed).tolist()
            assert got[name] == ids
        assert memo.reused == 1 and parser.fallbacks == 0
