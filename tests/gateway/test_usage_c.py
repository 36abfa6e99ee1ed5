"""The C usage reader (``usage_object``, gpuhit/_usage.c) against its reference,
``gateway.http.usage.usage_of_json``: on every answer the stage (:class:`UsageReader`) gives the
reference's object, and the C reader alone gives either that object or None (never another). The
same for an OpenAI answer's :class:`Usage` (``openai_usage_of`` against ``openai_usage`` of the
reference's object: :meth:`UsageReader.openai`)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http.usage import TAIL_MAX, Usage, UsageReader, openai_usage, usage_of_json

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

KEYS = st.sampled_from(["prompt_tokens", "total_tokens", "completion_tokens", "cached_tokens", "x_1", "reasoning",
                        "prompt_tokens_details"])
SCALARS = st.one_of(st.integers(0, 2**63 - 1), st.integers(-5, -1), st.none(), st.floats(0, 10, allow_nan=False),
                    st.text(max_size=3), st.booleans())
USAGE = st.dictionaries(KEYS, st.one_of(SCALARS, st.dictionaries(KEYS, SCALARS, max_size=3)), max_size=5)


def _answer(usage: object, pad: str = "", ws: bool = False) -> bytes:
    body = orjson.dumps({"id": "cmpl-1", "choices": [{"text": "hi" + pad}], "usage": usage})
    if ws:  # the same JSON with whitespace around the colons, as some servers write it
        body = body.replace(b'":', b'" : ')
    return body


def _check(c_speedups, data: bytes) -> None:
    ref = usage_of_json(data)
    raw = c_speedups.usage_object(data[-TAIL_MAX:])
    assert raw is None or raw == ref
    reader = UsageReader(c_speedups)
    assert reader.of_json(data) == ref
    assert reader.fallbacks == (raw is None)
    assert UsageReader().of_json(data) == ref
    # the OpenAI Usage: the C reader's, or None (the reference then decides), never another
    expected = _or_error(lambda: openai_usage(ref))
    c = c_speedups.openai_usage_of(data[-TAIL_MAX:], Usage)
    assert c is None or (type(c) is Usage and c == expected)
    assert _or_error(lambda: UsageReader(c_speedups).openai(data)) == expected
    assert _or_error(lambda: UsageReader().openai(data)) == expected


def _or_error(f):
    try:
        return f()
    except (TypeError, ValueError) as exc:  # int() of an object or a string as completion_tokens: the reference raises
        return type(exc)


@SETTINGS
@given(USAGE, st.text(max_size=20), st.booleans())
def test_the_c_reader_gives_the_references_usage_or_none(c_speedups, usage, pad, ws):
    _check(c_speedups, _answer(usage, pad, ws))


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_tails_agree(c_speedups, tail):
    _check(c_speedups, tail)
    _check(c_speedups, b'{"usage":' + tail)


@pytest.mark.parametrize("data", [
    _answer({"prompt_tokens": 12, "total_tokens": 16, "completion_tokens": 4,
             "prompt_tokens_details": {"cached_tokens": 0}}),
    _answer(None),
    _answer({}),
    _answer({"prompt_tokens": 12})[:-1],  # cut off after the usage object
    _answer({"prompt_tokens": 12})[:-3],  # cut off inside it
    b'{"usage": {"prompt_tokens": 01}}',  # not JSON
    b'{"usage":{"prompt_tokens":123456789012345678901}}',  # beyond the C reader's 18 digits
    b'{"choices":[],"usage":{"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":16}}}',
    b'{"usage":{"completion_tokens":{},"prompt_tokens_details":{"cached_tokens":null}}}',
    b'{"usage":{"completion_tokens":{"a":1},"prompt_tokens_details":7}}',  # the reference raises
    b'{"usage":{"completion_tokens":null,"prompt_tokens_details":{"cached_tokens":{"x":1}}}}',
    b'{"usage":{"prompt_tokens_details":{"cached_tokens":3},"prompt_tokens_details":{}}}',
    b"x" * (TAIL_MAX + 10) + _answer({"completion_tokens": 4}),
    b"",
    b'"usage"',
])
def test_edge_cases(c_speedups, data):
    _check(c_speedups, data)


def test_the_common_answer_takes_the_c_path(c_speedups):
    data = _answer({"prompt_tokens": 12, "total_tokens": 16, "completion_tokens": 4,
                    "prompt_tokens_details": {"cached_tokens": 0}})
    reader = UsageReader(c_speedups)
    assert reader.of_json(data) == {"prompt_tokens": 12, "total_tokens": 16, "completion_tokens": 4,
                                    "prompt_tokens_details": {"cached_tokens": 0}}
    assert reader.openai(data) == Usage(0, 4)
    assert reader.fallbacks == 0
