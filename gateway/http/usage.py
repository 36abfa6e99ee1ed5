"""The realized prefix hit of an answer: its ``usage`` object, found in the answer's tail without
parsing the rest (vLLM puts ``usage`` last, in the final SSE event or at the end of the JSON), and
read into a :class:`Usage`, the shape the gateway's bookkeeping takes from every prompt dialect."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import msgspec
import orjson

from engines.vllm import protocol

TAIL_MAX = 4096  # bytes of a JSON answer's end searched for its usage object


class Usage(msgspec.Struct, frozen=True, gc=False):
    """What an engine reported of one answer: prompt tokens served from its prefix cache (0 when it
    sent usage without the detail) and tokens generated. A msgspec Struct: built in C, one per
    answer (a frozen dataclass sets each field through ``object.__setattr__``)."""

    cached_tokens: int
    completion_tokens: int


def openai_usage(u: Any) -> Usage | None:
    """An OpenAI-shaped ``usage`` object (``prompt_tokens_details.cached_tokens``,
    ``completion_tokens``) as a :class:`Usage`; None when there is none."""
    if not isinstance(u, dict):
        return None
    details = u.get("prompt_tokens_details")
    if type(details) is dict:  # parsed JSON: protocol.cached_tokens_of's first case, without its call
        cached = details.get("cached_tokens")
        if not isinstance(cached, int):
            cached = 0
    else:
        cached = protocol.cached_tokens_of(u) or 0
    return Usage(cached, int(u.get("completion_tokens") or 0))


def usage_of_json(data: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole (non-streamed) JSON answer: the last ``"usage": {...}`` in
    its last :data:`TAIL_MAX` bytes (:func:`usage_from_tail`), whatever the answer's size."""
    return usage_from_tail(data[-TAIL_MAX:], sse=False)


class UsageReader:
    """The usage stage of a non-streamed answer as one gateway runs it: the C reader when ``accel``
    (the C speedups, :func:`gpuhit.speedups.load`) is given, else :func:`usage_of_json`, the
    reference. The C reader takes only the common compact shape and answers None for anything else
    (no usage, whitespace, floats, a cut-off body), which the reference then decides: the objects
    are the same either way (``tests/gateway/test_usage_c.py``). ``fallbacks`` counts those. For the
    OpenAI dialects, :meth:`openai` reads the :class:`Usage` itself."""

    __slots__ = ("_c", "_c_openai", "fallbacks")

    def __init__(self, accel: ModuleType | None = None):
        self._c = None if accel is None else accel.usage_object
        self._c_openai = None if accel is None else accel.openai_usage_of
        self.fallbacks = 0

    def openai(self, data: bytes) -> Usage | None:
        """``openai_usage(self.of_json(data))``: an OpenAI answer's :class:`Usage` (the C reader builds
        it from the usage object it reads, without the Python conversion; where it answers None the
        reference decides, counted in ``fallbacks`` as :meth:`of_json`'s)."""
        if self._c_openai is not None:
            u = self._c_openai(data[-TAIL_MAX:], Usage)
            if u is not None:
                return u  # type: ignore[no-any-return]
            self.fallbacks += 1
        return openai_usage(usage_of_json(data))

    def of_json(self, data: bytes) -> dict[str, Any] | None:
        """The ``usage`` object of a whole JSON answer (None: it has none)."""
        if self._c is not None:
            u = self._c(data[-TAIL_MAX:])
            if u is not None:
                return u  # type: ignore[no-any-return]
            self.fallbacks += 1
        return usage_of_json(data)


def usage_from_tail(tail: bytes, sse: bool = True) -> dict[str, Any] | None:
    """The ``usage`` object of the last SSE event that has one, found in the stream's tail
    (``sse=False``: of a plain JSON body's tail, where ``"usage": {...}`` holds only scalars and
    the flat ``prompt_tokens_details`` object, and the answer goes on to close: a body cut off
    after its usage object gives None rather than a guess)."""
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
        if tail.find(b"}", end + 1) < 0:  # the answer does not close after it: cut off
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
