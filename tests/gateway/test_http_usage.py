"""``usage_from_tail``: the realized hit found in an answer's tail without parsing the rest. The
plain-JSON case matches braces with C-level find / count; it must find exactly the object the
byte-by-byte depth count finds (the reference below), on vLLM-shaped answers cut anywhere and on
random brace soups."""

from __future__ import annotations

import random

import orjson

from gateway.http.usage import TAIL_MAX, usage_from_tail, usage_of_json


def reference(tail: bytes):
    """The byte-by-byte brace matcher ``usage_from_tail(sse=False)`` replaced."""
    at = tail.rfind(b'"usage"')
    if at < 0:
        return None
    start = tail.find(b"{", at)
    if start < 0 or tail[at + 7 : start].strip() != b":":
        return None
    depth = 0
    for j in range(start, len(tail)):
        if tail[j] == 123:
            depth += 1
        elif tail[j] == 125:
            depth -= 1
            if depth == 0:
                if b"}" not in tail[j + 1 :]:  # the answer does not close after it: cut off
                    return None
                try:
                    obj = orjson.loads(tail[start : j + 1])
                except ValueError:
                    return None
                return obj if isinstance(obj, dict) else None
    return None


def test_json_usage_of_a_vllm_answer_cut_anywhere():
    usage = {"prompt_tokens": 40, "total_tokens": 42, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 32}}
    body = orjson.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "} {\"usage\": {"}],
                         "usage": usage, "kv_transfer_params": None})
    assert usage_from_tail(body, sse=False) == usage
    for k in range(len(body)):
        assert usage_from_tail(body[k:], sse=False) == reference(body[k:])
        assert usage_from_tail(body[:k], sse=False) == reference(body[:k])
    assert usage_from_tail(b'{"usage": null}', sse=False) is None


def test_json_usage_matches_the_reference_on_random_brace_soups():
    rnd = random.Random(18)
    parts = [b"{", b"}", b'"usage"', b":", b" ", b"1", b",", b'"a"', b'"prompt_tokens_details"', b"null", b"[", b"]"]
    found = 0
    for _ in range(20_000):
        tail = (b'x"usage": {' if rnd.random() < 0.7 else b"") + b"".join(
            rnd.choice(parts) for _ in range(rnd.randint(0, 30)))
        got = usage_from_tail(tail, sse=False)
        assert got == reference(tail), tail
        found += got is not None
    assert found > 100  # the soups do reach the parse


def test_sse_usage_is_the_last_event_that_has_one():
    events = [{"choices": [{"text": " a"}]}, {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}},
              {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}]
    tail = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    assert usage_from_tail(tail) == {"prompt_tokens": 1, "completion_tokens": 2}
    assert usage_from_tail(b"data: [DONE]\n\n") is None


def test_whole_json_answers_short_and_long_give_the_same_usage():
    usage = {"prompt_tokens": 40, "total_tokens": 42, "completion_tokens": 2,
             "prompt_tokens_details": {"cached_tokens": 32}}
    # a short answer, and one longer than the tail searched
    for text in ("} {\"usage\": {", "x" * (2 * TAIL_MAX)):
        body = orjson.dumps({"id": "cmpl-1", "choices": [{"text": text}], "usage": usage, "kv_transfer_params": None})
        assert usage_of_json(body) == usage
        assert usage_of_json(body.replace(b'"usage":', b' "usage" : ')) == usage  # spaced JSON too
    assert usage_of_json(b'{"usage": null}') is None
    assert usage_of_json(b'{"usage": {"a": 1}') is None  # cut off: no usage rather than a guess
    assert usage_of_json(b'{"choices": []}') is None
