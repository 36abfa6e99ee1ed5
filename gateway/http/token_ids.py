"""The token-id stage: a completions body's ``"prompt": [ids...]`` array, from its JSON text to uint64.

A 100k-token prompt is ~600 KB of JSON; orjson would turn it into 100k Python ints (4-7 ms) that
routing then packs again. For the common shape, a flat array of plain non-negative integers, the
array's text is read straight into a uint64 buffer. Two implementations of that, chosen once where
the gateway is built (:class:`TokenIdParser`):

* the **reference**, numpy (every install has it): :func:`validated` checks the text with a few
  whole-array passes, numpy's C text reader parses it, and a prompt nobody holds yet is parsed only
  as far as its hashes are read (:class:`LazyIds`);
* the **fast path**, C (``make compile``: ``parse_uint_array`` in ``gpuhit/_tokenids.c``), which
  validates and converts in one pass.

Both accept exactly one language (``int (, int)*`` with JSON whitespace, each a non-negative JSON
integer of at most 18 digits: no sign, no leading zero); the C parser answers None for anything
else and the reference then decides (counted in :attr:`TokenIdParser.fallbacks`), so an id is never
parsed differently with or without the build. A body outside the language at all (signs, floats,
nested arrays, 19-digit ids) is parsed whole by orjson, which decides it and its error.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np

_DIGIT_MAX = 18  # digits of the largest id parsed here (< 2**63; longer ones go the orjson way)


def validated(raw: bytes, start: int, stop: int) -> tuple[bytes, np.ndarray] | None:
    """``(digits-and-commas text, comma positions)`` of the JSON array body ``raw[start:stop]``
    (the bytes between ``[`` and ``]``) when it is exactly ``int (, int)*`` with JSON whitespace,
    each a non-negative JSON integer (no sign, no leading zero) of at most 18 digits; else None."""
    seg = np.frombuffer(raw, dtype=np.uint8, count=stop - start, offset=start)
    n = len(seg)
    if n == 0:
        return None
    comma = seg == 44
    ends = np.flatnonzero(comma)  # each number ends just before its comma
    digit = (seg - 48) < 10  # uint8 arithmetic wraps: True exactly for b"0".."9"
    if int(np.count_nonzero(digit)) + len(ends) != n:
        # whitespace (or anything else): keep only JSON whitespace, then recheck
        ws = (seg == 32) | (seg == 9) | (seg == 10) | (seg == 13)
        if np.count_nonzero(~(digit | comma | ws)):
            return None
        # whitespace may not split a number: digit runs of the original = numbers (commas + 1)
        runs = int(np.count_nonzero(digit[1:] & ~digit[:-1])) + bool(digit[0])
        if runs != len(ends) + 1:
            return None
        seg = seg[~ws]
        n = len(seg)
        ends = np.flatnonzero(seg == 44)
    if len(ends):
        first, last = int(ends[0]), n - 1 - int(ends[-1])
        inner = np.diff(ends)  # an interior number's length + 1
        shortest = min(first, last, int(inner.min()) - 1 if len(inner) else n)
        widest = max(first, last, int(inner.max()) - 1 if len(inner) else 0)
    else:
        shortest = widest = n
    if shortest < 1 or widest > _DIGIT_MAX:  # an empty element (",," or an edge comma), or too long
        return None
    # a leading zero: a number that starts with "0" and goes on (its next byte is no comma)
    if seg[0] == 48 and n > 1 and seg[1] != 44:
        return None
    if widest > 1 and len(ends):
        zero = np.flatnonzero(seg[ends + 1] == 48)  # numbers after a comma that start with "0"
        if len(zero):
            after = ends[zero] + 2
            after = after[after < n]
            if np.count_nonzero(seg[after] != 44):
                return None
    return seg.tobytes(), ends


def _parse_text(text: bytes) -> np.ndarray:
    """The ids of validated ``digits (, digits)*`` text: numpy's C text reader (about 3x faster than
    assembling the values digit position by digit position)."""
    return np.fromstring(text, dtype=np.int64, sep=",").view(np.uint64)  # text mode: not deprecated


def parse_ids(raw: bytes, start: int, stop: int) -> np.ndarray | None:
    """The reference: the integers of the JSON array body ``raw[start:stop]`` when
    :func:`validated` accepts it; else None."""
    v = validated(raw, start, stop)
    return None if v is None else _parse_text(v[0])


class TokenIdParser:
    """The token-id stage as one gateway runs it: the C parser when ``accel`` (the C speedups,
    :func:`gpuhit.speedups.load`) is given, else the numpy reference. ``fallbacks`` counts the
    arrays the C parser handed to the reference (anything outside its language: the reference
    then decides, and for a valid array finds the same ids); ``/debug/state`` reports it."""

    __slots__ = ("_c", "fallbacks")

    def __init__(self, accel: ModuleType | None = None):
        self._c = None if accel is None else accel.parse_uint_array
        self.fallbacks = 0

    @property
    def fast(self) -> bool:
        """Whether the C parser runs."""
        return self._c is not None

    def parse(self, raw: bytes, start: int, stop: int) -> np.ndarray | None:
        """Every id of the array text ``raw[start:stop]`` (between the brackets), or None outside the language."""
        if self._c is not None:
            buf = self._c(raw, start, stop)
            if buf is not None:
                return np.frombuffer(buf, dtype=np.uint64)
            self.fallbacks += 1
        return parse_ids(raw, start, stop)

    def lazy(self, raw: bytes, start: int, stop: int) -> np.ndarray | LazyIds | None:
        """The ids as :meth:`parse` finds them, but with the reference parsed only as far as they
        are read (:class:`LazyIds`): a prompt no engine holds is hashed one block deep. The C parser
        converts in the pass that validates, so it parses all of them."""
        if self._c is not None:
            buf = self._c(raw, start, stop)
            if buf is not None:
                return np.frombuffer(buf, dtype=np.uint64)
            self.fallbacks += 1
        v = validated(raw, start, stop)
        return None if v is None else LazyIds(*v)


REFERENCE = TokenIdParser()  # what runs without the C speedups


class LazyIds:
    """Validated token ids of a JSON array, parsed only as far as they are read.

    A prompt routed on a lazily hashed chain (:class:`engines.hashing.PromptHashes`) needs the ids
    of the blocks it hashes, which for a prompt no instance holds is one block: the 100k ids of
    a fresh 100k-token prompt are counted and checked (:func:`validated`), not parsed. Reads
    parse the prefix they reach (at least doubling what is parsed, so reading on costs linear
    time overall). Offers what routing reads of a uint64 array: ``len``, indexing and slicing
    (numpy results), ``max``, ``tolist`` and ``np.asarray``.
    """

    __slots__ = ("_commas", "_n", "_parsed", "_text")

    def __init__(self, text: bytes, commas: np.ndarray):
        self._text = text
        self._commas = commas
        self._n = len(commas) + 1
        self._parsed = _NO_IDS

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        """What it holds once parsed: its text, the comma positions and the ids (a memo's account)."""
        return len(self._text) + self._commas.nbytes + 8 * self._n

    @property
    def parsed(self) -> int:
        """How many leading ids have been parsed."""
        return len(self._parsed)

    def _upto(self, k: int) -> np.ndarray:
        done = self._parsed
        p = len(done)
        if k <= p:
            return done
        n = self._n
        k = min(n, max(k, 2 * p, 64))
        start = 0 if p == 0 else int(self._commas[p - 1]) + 1
        stop = int(self._commas[k - 1]) if k < n else len(self._text)
        more = _parse_text(self._text[start:stop])
        self._parsed = more if p == 0 else np.concatenate((done, more))
        return self._parsed

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            _, stop, step = i.indices(self._n)
            return self._upto(stop if step > 0 else self._n)[i]
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError("token index out of range")
        return self._upto(j + 1)[j]

    def array(self) -> np.ndarray:
        """Every id, parsed."""
        return self._upto(self._n)

    def max(self) -> np.uint64:
        return self.array().max()

    def tolist(self) -> list[int]:
        return self.array().tolist()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:  # type: ignore[no-untyped-def]
        a = self.array()
        return a if dtype is None else a.astype(dtype)


_NO_IDS = np.zeros(0, dtype=np.uint64)


class TokenIds(Sequence[int]):
    """Token ids parsed into a uint64 array (this stage), read as a sequence of Python ints where a
    list is expected (a KV-moving producer request re-serializes them)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray | LazyIds):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i):  # type: ignore[override]
        return self.array[i].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())


def pack_token_ids(prompt: list[Any]) -> array | None:
    """``array('Q', prompt)`` (a prompt list orjson parsed: a small body, or one outside this
    stage's language) if every element is a non-negative 64-bit int, else None: validation in one C
    conversion (negative -> OverflowError, non-int -> TypeError), reused for hashing."""
    try:
        return array("Q", prompt)
    except (TypeError, OverflowError):
        return None
