"""The realized prefix hit of an answer: its ``usage`` object, found in the answer's tail without
parsing the rest (vLLM puts ``usage`` last, in the final SSE event or at the end of the JSON)."""

from __future__ import annotations

from typing import Any

import orjson

WHOLE_MAX = 4096  # a JSON answer up to this size is parsed whole: one C call, the least code per answer


def usage_of_json(data: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole (non-streamed) JSON answer: a short one parsed whole, a long
    one (many choices, logprobs) from its tail (:func:`usage_from_tail`)."""
    if len(data) > WHOLE_MAX:
        return usage_from_tail(data[-WHOLE_MAX:], sse=False)
    try:
        doc = orjson.loads(data)
    except ValueError:
        return None
    u = doc.get("usage") if type(doc) is dict else None
    return u if type(u) is dict else None


def usage_from_tail(tail: bytes, sse: bool = True) -> dict[str, Any] | None:
    """The ``usage`` object of the last SSE event that has one, found in the stream's tail
    (``sse=False``: of a plain JSON body's tail, where ``"usage": {...}`` holds only scalars and
    the flat ``prompt_tokens_details`` object)."""
    if not sse:
        at = tail.rfind(b'"usage"')
        if at < 0:
            return None
        start = tail.find(b"{", at)
        if start < 0 or tail[at + 7 : start].strip() != b":":  # "usage": null, or cut off
            return None
        # The object ends at the first "}" where the braces since `start` balance, found by C-level
        # find / count (a Python loop over its bytes cost ~5 us a request).
        end = tail.find(b"}", start)
        while end >= 0 and tail.count(b"{", start, end) != tail.count(b"}", start, end) + 1:
            end = tail.find(b"}", end + 1)
        if end < 0:
            return None
        try:
            obj = orjson.loads(tail[start : end + 1])
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None
    at = tail.rfind(b'"usage"')
    while at >= 0:
        start = tail.rfind(b"data:", 0, at)
        end = tail.find(b"\n\n", at)
        if start >= 0:
            try:
                obj = orjson.loads(tail[start + 5 : end if end >= 0 else len(tail)])
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                return obj["usage"]
        at = tail.rfind(b'"usage"', 0, start if start >= 0 else at)
    return None
