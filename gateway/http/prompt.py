"""From a request body to what routing needs: prompt length and block hashes.

* **Token-id prompts** (the replayer, any client sending ids): exact vLLM block hashes through
  :class:`engines.hashing.BlockHasher`, memoized per session. A large completions body's id array is
  parsed straight into a numpy buffer (:func:`fast_completion_ids`); a prompt that repeats or extends
  the previous one of its session (without a session: the last one whose text starts alike) parses
  only its new ids (:class:`PromptMemo`); the blocks' pickles are laid out with numpy
  (:meth:`engines.hashing.BlockHasher.hash_array`); the client's bytes are forwarded unchanged.
  Agentic turn k+1 extends turn k, so
  :class:`engines.hashing.SessionHashCache` keeps each session's last prompt and digests and hashes only the new
  blocks (a 100k-token prompt is never re-hashed). The session key is the ``x-session-id`` header
  when sent, else the first block's tokens (so two sessions with a shared system prompt share an
  entry; the longest-common-prefix check keeps that correct, just less effective).
* **Text and chat prompts** with a tokenizer (``--tokenizer``, or the engines' model directory):
  tokenized exactly as vLLM does (:mod:`gateway.tokenizer`), then as above.
* **Text and chat prompts** without one (or what the tokenizer cannot reproduce exactly): an
  *approximate* chained hash of ``text_chunk_chars``-character chunks (64 chars ~ 16 tokens). These
  hashes do not match engine block hashes, so with the precise index such a prompt sees no predicted
  hit; the approximate index (routing history) learns them, and cold/warm placement by load still
  works. Token counts are estimated as ``len(text) / 4``; the gateway counts these requests in
  ``/debug/state`` ``approximate_prompts``.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from gpuhit.errors import BadRequestError, ConfigError

CHARS_PER_TOKEN = 4


def text_chunk_hashes(text: str, chunk_chars: int) -> list[int]:
    """Approximate chained hashes of full ``chunk_chars`` chunks of ``text`` (see module docstring):
    ``blake2b-64(previous digest + chunk)`` of each chunk of its UTF-8 bytes, as a big-endian int."""
    data = text.encode("utf-8", "surrogatepass")
    out: list[int] = []
    prev = b""
    step = chunk_chars
    for start in range(0, len(data) - step + 1, step):
        prev = hashlib.blake2b(prev + data[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """Messages flattened for approximate hashing (role + text parts, in order)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        elif content is not None and not isinstance(content, str):
            raise BadRequestError("messages[].content must be a string or a list of content parts")
        parts.append(f"{m.get('role')}\n{content or ''}\n")
    return "".join(parts)


def vocab_size_of(path: str) -> int:
    """The model's vocabulary size from its Hugging Face ``config.json`` (a file, or a model folder
    holding one): ``vocab_size``, or ``text_config.vocab_size`` for multimodal configs (what vLLM's
    ``ModelConfig.get_vocab_size`` reads)."""
    import json
    import os

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model config {file}: {exc}") from None
    size = doc.get("vocab_size") if isinstance(doc, dict) else None
    if size is None and isinstance(doc, dict) and isinstance(doc.get("text_config"), dict):
        size = doc["text_config"].get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ConfigError(f"{file} names no positive vocab_size (or text_config.vocab_size)")
    return size


def pack_token_ids(prompt: list[Any]) -> array | None:
    """``array('Q', prompt)`` if every element is a non-negative 64-bit int, else None: validation
    in one C conversion (negative -> OverflowError, non-int -> TypeError), reused for hashing."""
    try:
        return array("Q", prompt)
    except (TypeError, OverflowError):
        return None


def header_value(s: str) -> str:
    """``s`` made safe for an HTTP header value: ASCII, one line, at most 200 characters."""
    return s.encode("ascii", "replace").decode()[:200].replace("\r", " ").replace("\n", " ")


# --------------------------------------------------------------------------- fast token-id parse
#
# A 100k-token prompt is ~600 KB of JSON; orjson turns it into 100k Python ints (4-7 ms) that
# routing then packs again. For the common shape, a flat array of plain non-negative integers under
# the top-level "prompt" key, the array is parsed straight into a numpy buffer and only the rest of
# the body goes through orjson (with a random sentinel in the array's place). Anything else (no
# such key, whitespace oddities outside JSON's, signs, floats, nested arrays, leading zeros, ids of
# 19+ digits, a "prompt" key that turns out nested or overridden) returns None and the caller parses
# the whole body as before: the fast path never decides an error, so errors stay exactly the same.
_SENTINEL = "\x00gpuhit-ids-" + secrets.token_hex(8)  # unguessable: only our substitution produces it
_SENTINEL_JSON = orjson.dumps(_SENTINEL)
_WS = b" \t\n\r"
# Bodies below this are parsed whole by orjson (the reference): as fast as the fast path for their
# few hundred ids (both ~13 us at 500 ids; at 2,000 ids orjson takes ~44 us, the fast path ~19 us).
FAST_PARSE_MIN_BYTES = 4096
_DIGIT_MAX = 18  # digits of the largest id parsed here (< 2**63; longer ones go the orjson way)


def _skip_ws(raw: bytes, i: int) -> int:
    n = len(raw)
    while i < n and raw[i] in _WS:
        i += 1
    return i


def _validated(raw: bytes, start: int, stop: int) -> tuple[bytes, np.ndarray] | None:
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
    """The integers of the JSON array body ``raw[start:stop]`` when :func:`_validated` accepts it;
    else None."""
    v = _validated(raw, start, stop)
    return None if v is None else _parse_text(v[0])


class LazyIds:
    """Validated token ids of a JSON array, parsed only as far as they are read.

    A prompt routed on a lazily hashed chain (:class:`engines.hashing.PromptHashes`) needs the ids
    of the blocks it hashes, which for a prompt no instance holds is one block: the 100k ids of
    a fresh 100k-token prompt are counted and checked (:func:`_validated`), not parsed. Reads
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


def _prompt_span(raw: bytes) -> tuple[int, int] | None:
    """``(at "[", at "]")`` of the first ``"prompt": [ ... ]`` in ``raw`` (the bytes may also occur as a
    string value, hence the loop); None when there is none. Whether it is the top-level prompt is for
    the caller to check."""
    at = raw.find(b'"prompt"')
    while at >= 0:
        i = _skip_ws(raw, at + 8)
        if i < len(raw) and raw[i] == 58:  # ':'
            j = _skip_ws(raw, i + 1)
            if j < len(raw) and raw[j] == 91:  # '['
                rb = raw.find(b"]", j)
                return None if rb < 0 else (j, rb)
        at = raw.find(b'"prompt"', at + 8)
    return None


_KEY_BYTES = 256  # ~40 token ids


def memo_key(session: str | None, raw: bytes, start: int, stop: int) -> str | bytes:
    """A prompt's :class:`PromptMemo` key: its session, else the first ``_KEY_BYTES`` bytes of its array
    text (as :class:`engines.hashing.SessionHashCache` keys a session-less prompt by its first block:
    prompts that start alike share the entry; a str never equals bytes)."""
    return session if session is not None else raw[start : min(stop, start + _KEY_BYTES)]


def fast_completion_ids(raw: bytes, memo: PromptMemo | None = None, session: str | None = None
                        ) -> tuple[dict[str, Any], np.ndarray | LazyIds] | None:
    """(body without its ``prompt`` key, token ids) of a completions body whose top-level ``prompt`` is a
    flat array of plain non-negative integers; None for any other body (parse it whole). With a
    ``memo``, a prompt that repeats or extends the previous one of its key (:func:`memo_key`) parses
    only its new ids (see :class:`PromptMemo`); otherwise a named session's ids are parsed now (the
    memo keeps them for the next turn, whose hashes reach through all of them) and any other's come
    as :class:`LazyIds`."""
    span = _prompt_span(raw)
    if span is None:
        return None
    lb, rb = span
    key: str | bytes = b""  # set below whenever it is used (with a memo)
    ids = None
    if memo is not None:
        key = memo_key(session, raw, lb + 1, rb)
        ids = memo.extend(key, raw, lb + 1, rb)
    if ids is None:
        v = _validated(raw, lb + 1, rb)
        ids = None if v is None else _parse_text(v[0]) if memo is not None and session is not None else LazyIds(*v)
        if ids is None:
            return None
    try:
        body = orjson.loads(raw[:lb] + _SENTINEL_JSON + raw[rb + 1 :])
    except orjson.JSONDecodeError:
        return None
    # The array was the top-level prompt (not nested, not overridden by a later duplicate key):
    # the sentinel is where the prompt is. The rest of the body parsed the same as it would whole.
    if not isinstance(body, dict) or body.get("prompt") != _SENTINEL:
        return None
    # The sentinel only marked the array's place for that check: the body handed on has no prompt
    # (what is forwarded is the client's bytes, never this body).
    del body["prompt"]
    if memo is not None:
        memo.remember(key, _text_of(raw, lb + 1, rb), ids)
    return body, ids


class PromptMemo:
    """The last token-id prompt of each key (a session, else how its array text starts:
    :func:`memo_key`), as its JSON text and its ids (LRU).

    An agentic turn resends the previous prompt plus new tokens, and a retry or a repeated
    evaluation prompt resends it unchanged. When the new array text starts with the remembered one
    followed by JSON whitespace and a comma, only the text after it is parsed (:func:`parse_ids`)
    and appended to the remembered ids; when it is the same text, the ids are reused as they are:
    one ``memcmp`` over the old text instead of parsing it again. The body is still validated
    whole (the caller parses the rest of it and checks the prompt's place) so the answer is exactly
    what a full parse gives. An entry learnt from a body parsed whole (:meth:`learn`) is checked
    once, at its first use, to be the canonical text of its ids. Memory: the array text of each
    entry (~6 bytes a token) and its ids, at most ``max_sessions`` entries and ``max_bytes`` in all.
    """

    def __init__(self, max_sessions: int = 1024, max_bytes: int = 256 << 20):
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes  # text + ids kept in all (a 100k-token prompt: ~1.4 MB)
        self.bytes = 0
        # key -> (array text, ids, whether the text is known to be the ids' own)
        self._last: OrderedDict[str | bytes, tuple[bytes | memoryview, np.ndarray | LazyIds, bool]] = OrderedDict()
        self.reused = 0  # prompts that parsed only their new ids, or none (tests, /debug/state)

    def extend(self, key: str | bytes, raw: bytes, start: int, stop: int) -> np.ndarray | LazyIds | None:
        """The ids of ``raw[start:stop]`` (an array's text without its brackets) if it repeats or
        extends the previous prompt of ``key``, else None."""
        last = self._last.get(key)
        if last is None:
            return None
        text, ids, checked = last
        cut = start + len(text)
        if cut > stop or not raw.startswith(text, start):
            return None
        if not checked:
            if orjson.dumps(np.asarray(ids), option=orjson.OPT_SERIALIZE_NUMPY)[1:-1] != text:
                self._forget(key)  # not orjson's own text of those ids (spacing, or another array)
                return None
            self._last[key] = (text, ids, True)
        if cut == stop:  # the same prompt again (a retry, a repeated prompt)
            self.reused += 1
            return ids
        i = _skip_ws(raw, cut)
        if i >= stop or raw[i] != 44:  # a comma must join the two parts (`text` ends in a digit or space)
            return None
        more = parse_ids(raw, i + 1, stop)
        if more is None:
            return None
        self.reused += 1
        return np.concatenate((np.asarray(ids), more))

    def remember(self, key: str | bytes, text: bytes | memoryview, ids: np.ndarray | LazyIds,
                 checked: bool = True) -> None:
        """Keep ``text`` (an array's text) and its ``ids`` as ``key``'s last prompt; ``checked=False``
        when the text is not known to be the ids' (verified at first use). The gateway passes a view
        of the request body rather than a copy of the array's text: a new prompt's copy was an
        allocation and a memcpy of its size on every request, for the one that repeats or extends it."""
        last = self._last
        if key in last:
            self._forget(key)
        last[key] = (text, ids, checked)
        self.bytes += _held(text) + ids.nbytes
        while len(last) > 1 and (len(last) > self.max_sessions or self.bytes > self.max_bytes):
            self._forget(next(iter(last)))

    def learn(self, raw: bytes, session: str | None, ids: np.ndarray) -> None:
        """Remember the token-id prompt of a body that was parsed whole (``ids``: its top-level
        prompt) under the text of its first ``"prompt"`` array, checked at first use."""
        span = _prompt_span(raw)
        if span is not None:
            lb, rb = span
            self.remember(memo_key(session, raw, lb + 1, rb), _text_of(raw, lb + 1, rb), ids, checked=False)

    def _forget(self, key: str | bytes) -> None:
        text, ids, _ = self._last.pop(key)
        self.bytes -= _held(text) + ids.nbytes


def _text_of(raw: bytes, start: int, stop: int) -> bytes | memoryview:
    """``raw[start:stop]`` for a memo entry: a view when ``raw`` is immutable bytes (no copy), else
    a copy (a buffer the caller may change or reuse)."""
    return memoryview(raw)[start:stop] if type(raw) is bytes else bytes(raw[start:stop])


def _held(text: bytes | memoryview) -> int:
    """The bytes a memo entry's text keeps alive: a view holds its whole body."""
    return len(text.obj) if isinstance(text, memoryview) else len(text)  # type: ignore[arg-type]


class TokenIds(Sequence[int]):
    """Token ids parsed into a uint64 array (:func:`fast_completion_ids`), read as a sequence of
    Python ints where a list is expected (a KV-moving producer request re-serializes them)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i):  # type: ignore[override]
        return self.array[i].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())
