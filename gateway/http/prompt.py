"""From a request body to what routing needs: prompt length and block hashes.

* **Token-id prompts** (the replayer, any client sending ids): exact vLLM block hashes through
  :class:`engines.hashing.BlockHasher`, memoized per session. A large completions body's id array is
  read straight into a uint64 buffer (:func:`fast_completion_ids`, through the token-id stage of
  :mod:`gateway.http.token_ids`); a prompt that repeats or extends the previous one of its session
  (without a session: the last one whose text starts alike) parses only its new ids
  (:class:`PromptMemo`); the client's bytes are forwarded unchanged. Agentic turn k+1 extends turn
  k, so :class:`engines.hashing.SessionHashCache` keeps each session's last prompt and digests and
  hashes only the new blocks (a 100k-token prompt is never re-hashed). The session key is the
  ``x-session-id`` header when sent, else the first block's tokens (so two sessions with a shared
  system prompt share an entry; the longest-common-prefix check keeps that correct, just less
  effective).
* **Text and chat prompts** with a tokenizer (``--tokenizer``, or the engines' model directory):
  tokenized exactly as vLLM does (:mod:`gateway.tokenizer`), then as above.
* **Text and chat prompts** without one (or what the tokenizer cannot reproduce exactly): an
  *approximate* chained hash of ``text_chunk_chars``-byte chunks of its UTF-8 (64 ~ 16 tokens). These
  hashes do not match engine block hashes, so with the precise index such a prompt sees no predicted
  hit; the approximate index (routing history) learns them, and cold/warm placement by load still
  works. Token counts are estimated as ``len(text) / 4``; the gateway counts these requests in
  ``/debug/state`` ``approximate_prompts``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orjson

from gateway.http.token_ids import REFERENCE, LazyIds, TokenIdParser
from gpuhit.errors import BadRequestError, ConfigError

CHARS_PER_TOKEN = 4


def text_chunk_hashes(text: str, chunk_bytes: int) -> list[int]:
    """Approximate chained hashes of the full ``chunk_bytes`` chunks of ``text``'s UTF-8 bytes (see
    module docstring; surrogates pass through): of each chunk, BLAKE2b-512 of the previous digest
    and the chunk, the digest cut to its first 8 bytes, as their big-endian int. The reference; the
    C speedups' ``text_chunk_hashes`` (OpenSSL's BLAKE2b) gives the same ints
    (``tests/gateway/test_text_chunks_c.py``), and :class:`gateway.http.parse.Prompts` picks one.
    Only the gateway's own approximate index compares these, so the definition is the gateway's."""
    if chunk_bytes <= 0:
        raise ValueError("text_chunk_hashes: chunk_bytes must be positive")
    data = text.encode("utf-8", "surrogatepass")
    out: list[int] = []
    prev = b""
    blake2b = hashlib.blake2b
    for end in range(chunk_bytes, len(data) + 1, chunk_bytes):
        prev = blake2b(prev + data[end - chunk_bytes : end]).digest()[:8]
        out.append(int.from_bytes(prev, "big"))
    return out


def chat_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """Messages flattened for approximate hashing (role + text parts, in order)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if type(content) is not str:  # text content, the common case, without the isinstance calls
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


def header_value(s: str) -> str:
    """``s`` made safe for an HTTP header value: ASCII, one line, at most 200 characters."""
    return s.encode("ascii", "replace").decode()[:200].replace("\r", " ").replace("\n", " ")


# ------------------------------------------------------------------------------ the prompt array
#
# For a completions body whose top-level "prompt" is a flat array of plain non-negative integers,
# the array goes through the token-id stage (gateway/http/token_ids.py) and only the rest of the
# body through orjson (with a random sentinel in the array's place). Anything else (no such key,
# an array outside the stage's language, a "prompt" key that turns out nested or overridden)
# returns None and the caller parses the whole body: this path never decides an error, so errors
# stay exactly those of the whole-body parse.
_SENTINEL = "\x00gpuhit-ids-" + secrets.token_hex(8)  # unguessable: only our substitution produces it
_SENTINEL_JSON = orjson.dumps(_SENTINEL)
_WS = b" \t\n\r"
# Bodies below this are parsed whole by orjson: as fast as the stage for their few hundred ids
# (both ~13 us at 500 ids with numpy; at 2,000 ids orjson takes ~44 us, numpy ~19 us, C ~6 us).
FAST_PARSE_MIN_BYTES = 4096


def _skip_ws(raw: bytes, i: int) -> int:
    n = len(raw)
    while i < n and raw[i] in _WS:
        i += 1
    return i


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


def fast_completion_ids(raw: bytes, memo: PromptMemo | None = None, session: str | None = None,
                        ids_parser: TokenIdParser = REFERENCE) -> tuple[dict[str, Any], np.ndarray | LazyIds] | None:
    """(body without its ``prompt`` key, token ids) of a completions body whose top-level ``prompt`` is a
    flat array of plain non-negative integers; None for any other body (parse it whole). With a
    ``memo``, a prompt that repeats or extends the previous one of its key (:func:`memo_key`) parses
    only its new ids (see :class:`PromptMemo`); otherwise a named session's ids are parsed now (the
    memo keeps them for the next turn, whose hashes reach through all of them) and any other's as
    far as they are read (:meth:`~gateway.http.token_ids.TokenIdParser.lazy`). ``ids_parser``: the
    gateway's token-id stage (numpy, or C with ``make compile``)."""
    span = _prompt_span(raw)
    if span is None:
        return None
    lb, rb = span
    key: str | bytes = b""  # set below whenever it is used (with a memo)
    ids = None
    if memo is not None:
        key = memo_key(session, raw, lb + 1, rb)
        ids = memo.extend(key, raw, lb + 1, rb, ids_parser)
    if ids is None:
        if memo is not None and session is not None:
            ids = ids_parser.parse(raw, lb + 1, rb)
        else:
            ids = ids_parser.lazy(raw, lb + 1, rb)
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
    followed by JSON whitespace and a comma, only the text after it is parsed (the token-id stage)
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

    def extend(self, key: str | bytes, raw: bytes, start: int, stop: int,
               ids_parser: TokenIdParser = REFERENCE) -> np.ndarray | LazyIds | None:
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
        more = ids_parser.parse(raw, i + 1, stop)
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
