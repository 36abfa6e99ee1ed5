"""From a request body to what routing needs: prompt length and block hashes.

* **Token-id prompts** (the replayer, any client sending ids): exact vLLM block hashes through
  :class:`engines.hashing.BlockHasher`, memoized per session. A large completions body's id array is
  parsed straight into a numpy buffer (:func:`fast_completion_ids`; an agentic turn that extends the
  session's previous prompt parses only its new ids, :class:`PromptMemo`) and the blocks' pickles are
  laid out with numpy (:meth:`engines.hashing.BlockHasher.hash_array`); the client's bytes are
  forwarded unchanged. Agentic turn k+1 extends turn k, so
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
    """Approximate chained hashes of full ``chunk_chars`` chunks of ``text`` (see module docstring)."""
    out: list[int] = []
    prev = b""
    data = text.encode("utf-8", "surrogatepass")
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
# Smaller bodies parse faster whole (measured: orjson + array("Q") win below ~5k ids, ~35 KB).
FAST_PARSE_MIN_BYTES = 65536
_DIGIT_MAX = 18  # digits of the largest id parsed here (< 2**63; longer ones go the orjson way)


def _skip_ws(raw: bytes, i: int) -> int:
    n = len(raw)
    while i < n and raw[i] in _WS:
        i += 1
    return i


def _validated(seg: np.ndarray) -> tuple[bytes, np.ndarray] | None:
    """``(digits-and-commas text, comma positions)`` of the JSON array body ``seg`` (uint8 bytes
    between ``[`` and ``]``) when it is exactly ``int (, int)*`` with JSON whitespace, each a
    non-negative JSON integer (no sign, no leading zero) of at most 18 digits; else None."""
    n = len(seg)
    if n == 0:
        return None
    digit = (seg - 48) < 10  # uint8 arithmetic wraps: True exactly for b"0".."9"
    comma = seg == 44
    ndig = int(np.count_nonzero(digit))
    ncomma = int(np.count_nonzero(comma))
    if ndig + ncomma != n:  # whitespace (or anything else): keep only JSON whitespace, then recheck
        other = ~(digit | comma)
        ws = (seg == 32) | (seg == 9) | (seg == 10) | (seg == 13)
        if np.count_nonzero(other & ~ws):
            return None
        # whitespace may not split a number: digit runs of the original = numbers (commas + 1)
        runs = int(np.count_nonzero(digit[1:] & ~digit[:-1])) + bool(digit[0])
        if runs != ncomma + 1:
            return None
        keep = ~ws
        seg = seg[keep]
        digit = digit[keep]
        n = len(seg)
        comma = seg == 44
    ends = np.flatnonzero(comma)  # each number ends just before its comma
    if len(ends):
        inner = np.diff(ends)  # an interior number's length + 1
        shortest = min(int(ends[0]), n - 1 - int(ends[-1]), int(inner.min()) - 1 if len(inner) else n)
        widest = max(int(ends[0]), n - 1 - int(ends[-1]), int(inner.max()) - 1 if len(inner) else 0)
    else:
        shortest = widest = n
    if shortest < 1 or widest > _DIGIT_MAX:  # an empty element (",," or an edge comma), or too long
        return None
    if widest > 1:  # a leading zero (a "0" that starts a number and is followed by a digit): not JSON
        start = np.empty(n - 1, dtype=bool)
        start[0] = True
        start[1:] = comma[: n - 2]
        if np.count_nonzero(start & (seg[:-1] == 48) & digit[1:]):
            return None
    return seg.tobytes(), ends


def _parse_text(text: bytes) -> np.ndarray:
    """The ids of validated ``digits (, digits)*`` text: numpy's C text reader (about 3x faster than
    assembling the values digit position by digit position)."""
    return np.fromstring(text, dtype=np.int64, sep=",").view(np.uint64)  # text mode: not deprecated


def parse_ids(seg: np.ndarray) -> np.ndarray | None:
    """The integers of the JSON array body ``seg`` when :func:`_validated` accepts it; else None."""
    v = _validated(seg)
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
    def parsed(self) -> int:
        """How many leading ids have been parsed."""
        return len(self._parsed)

    def _upto(self, k: int) -> np.ndarray:
        done = self._parsed
        p = len(done)
        if k <= p:
            return done
        n = self._n
        k = min(n, max(k, 2 * p, 1024))
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


def fast_completion_ids(raw: bytes, memo: PromptMemo | None = None, session: str | None = None
                        ) -> tuple[dict[str, Any], np.ndarray | LazyIds] | None:
    """(body without its prompt, token ids) of a completions body whose top-level ``prompt`` is a
    flat array of plain non-negative integers; None for any other body (parse it whole). With a
    ``memo`` and a ``session``, a prompt that extends the session's previous one parses only the
    new ids (see :class:`PromptMemo`); without them the ids come as :class:`LazyIds`."""
    lb = -1
    at = raw.find(b'"prompt"')
    while at >= 0 and lb < 0:  # the first `"prompt": [` (the bytes may also occur as a string value)
        i = _skip_ws(raw, at + 8)
        if i < len(raw) and raw[i] == 58:  # ':'
            j = _skip_ws(raw, i + 1)
            if j < len(raw) and raw[j] == 91:  # '['
                lb = j
                break
        at = raw.find(b'"prompt"', at + 8)
    if lb < 0:
        return None
    rb = raw.find(b"]", lb)
    if rb < 0:
        return None
    ids: np.ndarray | LazyIds | None = None
    if memo is not None and session is not None:
        ids = memo.extend(session, raw, lb + 1, rb)
    if ids is None:
        v = _validated(np.frombuffer(raw, dtype=np.uint8, count=rb - lb - 1, offset=lb + 1))
        if v is None:
            return None
        # A named session's prompt is parsed now (the memo keeps its ids for the next turn, whose
        # hashes reach through all of them); any other is parsed as far as routing reads it.
        ids = _parse_text(v[0]) if memo is not None and session is not None else LazyIds(*v)
    try:
        body = orjson.loads(raw[:lb] + _SENTINEL_JSON + raw[rb + 1 :])
    except orjson.JSONDecodeError:
        return None
    # The array was the top-level prompt (not nested, not overridden by a later duplicate key):
    # the sentinel is where the prompt is. The rest of the body parsed the same as it would whole.
    if not isinstance(body, dict) or body.get("prompt") != _SENTINEL:
        return None
    if memo is not None and session is not None:
        memo.remember(session, raw[lb + 1 : rb], ids)
    return body, ids


def client_body(body: Mapping[str, Any], prompt_ids: Sequence[int] | None) -> dict[str, Any]:
    """``body`` as the client sent it: a prompt that :func:`fast_completion_ids` left as its sentinel
    gets the parsed ids back (for the few answers that re-serialize the body; the rest forward the
    client's bytes unchanged)."""
    if body.get("prompt") == _SENTINEL:
        if prompt_ids is None:
            raise ValueError("a fast-parsed body needs its prompt ids to be re-serialized")
        return {**body, "prompt": list(prompt_ids)}
    return dict(body)


class PromptMemo:
    """Each session's last token-id prompt, as its JSON text and its parsed ids (LRU).

    An agentic turn resends the previous prompt plus new tokens; when the new array text starts
    with the previous one followed by JSON whitespace and a comma, only the text after it is
    parsed (:func:`parse_ids`) and appended to the previous ids: one ``memcmp`` over the old text
    instead of parsing it again. The body is still validated whole (the caller parses the rest of
    it and checks the prompt's place) so the answer is exactly what a full parse gives. Memory: the
    array text of each remembered session (~6 bytes a token; the ids are shared with the session
    hash cache's copy), at most ``max_sessions`` of them and ``max_bytes`` in all.
    """

    def __init__(self, max_sessions: int = 1024, max_bytes: int = 256 << 20):
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes  # text + ids kept in all (a 100k-token prompt: ~1.4 MB)
        self.bytes = 0
        self._last: OrderedDict[str, tuple[bytes, np.ndarray]] = OrderedDict()
        self.reused = 0  # prompts that parsed only their new ids (tests, /debug/state)

    def extend(self, session: str, raw: bytes, start: int, stop: int) -> np.ndarray | None:
        """The ids of ``raw[start:stop]`` (an array's text without its brackets) if it extends the
        session's previous prompt, else None."""
        last = self._last.get(session)
        if last is None:
            return None
        text, ids = last
        cut = start + len(text)
        if cut > stop or not raw.startswith(text, start):
            return None
        if cut == stop:  # the same prompt again (a retry)
            self.reused += 1
            return ids
        i = _skip_ws(raw, cut)
        if i >= stop or raw[i] != 44:  # a comma must join the two parts (`text` ends in a digit or space)
            return None
        more = parse_ids(np.frombuffer(raw, dtype=np.uint8, count=stop - i - 1, offset=i + 1))
        if more is None:
            return None
        self.reused += 1
        return np.concatenate((ids, more))

    def remember(self, session: str, text: bytes, ids: np.ndarray) -> None:
        last = self._last
        old = last.get(session)
        if old is not None:
            self.bytes -= len(old[0]) + old[1].nbytes
        last[session] = (text, ids)
        last.move_to_end(session)
        self.bytes += len(text) + ids.nbytes
        while len(last) > 1 and (len(last) > self.max_sessions or self.bytes > self.max_bytes):
            _, (t, i) = last.popitem(last=False)
            self.bytes -= len(t) + i.nbytes


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
