"""Parse: from a request's bytes to what routing needs, as one :class:`ParsedRequest`.

A prompt dialect (OpenAI completions, OpenAI chat; new ones alike) is a small object with a
``path``, a ``parse`` from the body's bytes to a :class:`ParsedRequest`, and the two readers of
what its engine reports back (the usage of a whole answer, and of a stream's tail), so the rest of
the pipeline (route -> forward -> settle) is the same for every dialect. What dialects share (the
served model, max_tokens / context checks, block hashes of token ids, the approximate hash of text
the gateway cannot tokenize exactly) is :class:`Prompts`, built once per gateway. Adding a dialect:
a class satisfying :class:`Dialect`, built from a :class:`Prompts`, listed in :data:`DIALECTS` (the
gateway builds one of each; both transports serve :data:`PROMPT_PATHS`).

Bad input raises a :class:`~gpuhit.errors.BadRequestError` with vLLM's words where vLLM has them;
parsing never awaits (a parse is CPU work between two reads of the socket).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import msgspec
import numpy as np

from engines.hashing import SessionHashCache
from engines.vllm import protocol
from gateway.http.prompt import (
    CHARS_PER_TOKEN,
    FAST_PARSE_MIN_BYTES,
    PromptMemo,
    chat_text,
    fast_completion_ids,
    text_chunk_hashes,
)
from gateway.http.token_ids import LazyIds, TokenIdParser, TokenIds, pack_token_ids
from gateway.http.transport import CHAT, COMPLETIONS, MESSAGES, RESPONSES
from gateway.http.usage import Usage, UsageReader, openai_usage, usage_from_tail
from gateway.tokenizer import NotExact, PromptTokenizer
from gpuhit.errors import CapacityError, GpuhitError

_bad = protocol.bad_request


class ParsedRequest(msgspec.Struct):
    """A valid request, as routing and forwarding read it. ``body``: the parsed JSON object (a
    token-id prompt parsed apart may be missing from it: forwarding sends ``raw``, never ``body``);
    ``prompt_tokens``: its length in tokens (estimated for text routed approximately);
    ``max_tokens``: what the engine will run (clamped to the context left); ``block_hashes``: the
    prompt's full blocks' hashes; ``prompt_ids``: its token ids when known (None for text routed
    approximately). A msgspec Struct: built in C, one per request."""

    dialect: Dialect
    body: Mapping[str, Any]
    raw: bytes
    prompt_tokens: int
    max_tokens: int
    stream: bool
    block_hashes: Sequence[int]
    prompt_ids: Sequence[int] | None
    session: str | None
    # The engine the request must run on (it names state only that engine holds), else None: the policy's choice.
    pin: int | None = None
    # What the dialect keeps of the request until its answer is relayed (Dialect.answered).
    state: Any = None

    @property
    def endpoint(self) -> str:
        return self.dialect.path


#: an API's own error body: (message, status, error type) -> the JSON object its clients expect
ErrorBody = Callable[[str, int, str | None], dict[str, Any]]


class Dialect(Protocol):
    """One prompt dialect: its path, its parse, how its answers report usage, and its API's error
    shape (``error_body``; None: vLLM's OpenAI shape)."""

    path: str
    error_body: ErrorBody | None

    def parse(self, raw: bytes, session: str | None) -> ParsedRequest: ...

    def usage_of_answer(self, data: bytes) -> Usage | None:
        """The usage of a whole (non-streamed) 200 answer, None when it reports none."""
        ...

    def usage_of_stream(self, tail: bytes) -> Usage | None:
        """The usage found in a completed stream's last bytes, None when there is none."""
        ...

    def stream_complete(self, tail: bytes) -> bool:
        """Whether a stream whose last bytes are ``tail`` ended with its dialect's final event."""
        ...

    def answered(self, req: ParsedRequest, target: int, data: bytes, streamed: bool) -> None:
        """``req``'s 200 answer was relayed from engine ``target`` (``data``: the whole answer, or
        a stream's tail): what the dialect learns from it (the Responses history)."""
        ...


class Prompts:
    """What every dialect's parse shares: the served model and its limits, exact block hashes of
    token ids (memoized per session, :class:`engines.hashing.SessionHashCache`), the engines'
    tokenizer when there is one, the token-id stage (:class:`~gateway.http.token_ids.TokenIdParser`:
    C with ``accel``, the C speedups, else numpy), the usage stage of a whole answer
    (:class:`~gateway.http.usage.UsageReader`, likewise), and the approximate hash of text
    (:func:`~gateway.http.prompt.text_chunk_hashes`, or the same hashes in C with ``accel``).
    ``not_exact`` counts the requests routed by an approximate hash, by reason (``/debug/state``)."""

    def __init__(self, model: str, hash_cache: SessionHashCache, block_size: int, *,
                 tokenizer: PromptTokenizer | None = None, max_model_len: int | None = None,
                 max_prompt_tokens: int = 0, vocab_size: int = 0, text_chunk_chars: int = 64,
                 memo: PromptMemo | None = None, accel: ModuleType | None = None):
        self.model = model
        self.hash_cache = hash_cache
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens
        self.vocab_size = vocab_size
        self.text_chunk_chars = text_chunk_chars
        self.memo = PromptMemo() if memo is None else memo
        self.ids = TokenIdParser(accel)
        self.usage = UsageReader(accel)
        self._text_hashes: Callable[[str, int], list[int]] = (
            text_chunk_hashes if accel is None else accel.text_chunk_hashes)
        self.not_exact: dict[str, int] = {}
        self._no_tokenizer: dict[str, str] = {}  # label -> its reason without a tokenizer
        self._served = f" Served: `{model}`."

    def body(self, raw: bytes) -> dict[str, Any]:
        """The JSON object of ``raw``, for the served model (400 / 404 otherwise)."""
        return protocol.parse_body(raw, self.model, self._served)

    def check_model(self, body: Mapping[str, Any]) -> None:
        protocol.check_model(body, self.model, self._served)

    @staticmethod
    def options(body: Mapping[str, Any], max_name: str = "max_tokens") -> tuple[int, bool]:
        """(max_tokens, stream) of a body; ``max_name``: the dialect's name for max_tokens."""
        mt = body.get(max_name, 16)
        if mt is None:
            mt = 16
        # type() first: parsed JSON gives a plain int, and the isinstance pair costs two calls.
        if (type(mt) is not int and (not isinstance(mt, int) or isinstance(mt, bool))) or mt < 1:
            raise _bad(f"{max_name} must be a positive integer, got {mt!r}", max_name)
        stream = body.get("stream", False)
        if type(stream) is not bool:  # bool has no subclasses
            raise _bad("stream must be a boolean", "stream")
        return mt, stream

    def check_len(self, n: int, max_tokens: int) -> int:
        """The max_tokens the engine will run (vLLM clamps it to the context left), or a 400 as vLLM's."""
        if n <= 0:
            raise _bad("prompt is empty", "prompt")
        cap = self.max_prompt_tokens
        if cap and n > cap:
            raise CapacityError(f"prompt of {n} tokens exceeds the gateway's limit of {cap} tokens")
        return protocol.check_context_length(n, max_tokens, self.max_model_len)

    def approximate(self, reason: str) -> None:
        self.not_exact[reason] = self.not_exact.get(reason, 0) + 1

    def text(self, text: str) -> tuple[int, tuple[int, ...]]:
        """(estimated tokens, approximate hashes) of text the gateway cannot tokenize exactly."""
        hashes = self._text_hashes(text, self.text_chunk_chars)
        # at least the hashed chunks' blocks, and 1 (max(), without its call: see
        # engines.base.max_cached_tokens)
        n = len(text) // CHARS_PER_TOKEN
        full = len(hashes) * self.block_size
        n = n if n > full else full  # noqa: FURB136
        return (n if n > 0 else 1), tuple(hashes)

    def exact(self, ids: list[int], session: str | None) -> Sequence[int]:
        """Block hashes of a token-id list (the tokenizer's, or the client's)."""
        if not ids:
            raise _bad("prompt is empty", "prompt")
        return self.hash_cache.hashes(ids, session)

    def rendered(self, dialect: Dialect, body: Mapping[str, Any], raw: bytes, max_tokens: int, stream: bool,
                 session: str | None, label: str, render: Callable[[], list[int]], text: Callable[[], str],
                 pin: int | None = None) -> ParsedRequest:
        """A prompt the engines render from messages (chat, Messages, Responses): ``render()``
        gives the token ids vLLM runs (the engines' chat template and tokenizer), routed exactly;
        without a tokenizer, or when ``render`` raises :class:`NotExact`, :meth:`approximated` of
        ``text()``. ``pin``: the :class:`ParsedRequest`'s."""
        if self.tokenizer is None:
            return self.approximated(dialect, body, raw, max_tokens, stream, session, label, text(), pin)
        try:
            ids = render()
            hashes = self.exact(ids, session)
            return ParsedRequest(dialect, body, raw, len(ids), self.check_len(len(ids), max_tokens), stream,
                                 hashes, ids, session, pin)
        except NotExact as exc:
            self.approximate(f"{label}: {exc}")
            n, text_hashes = self.text(text())
            return ParsedRequest(dialect, body, raw, n, self.check_len(n, max_tokens), stream, text_hashes, None,
                                 session, pin)

    def approximated(self, dialect: Dialect, body: Mapping[str, Any], raw: bytes, max_tokens: int, stream: bool,
                     session: str | None, label: str, text: str, pin: int | None = None) -> ParsedRequest:
        """A rendered prompt (:meth:`rendered`) without a tokenizer: routed by the approximate hash
        of ``text``, counted under ``label``'s "no tokenizer" (a dialect without a tokenizer may
        call this directly, without building ``rendered``'s callables)."""
        reason = self._no_tokenizer.get(label)  # the same reason every request: formatted once
        if reason is None:
            reason = self._no_tokenizer[label] = f"{label}: no tokenizer"
        counts = self.not_exact  # approximate(reason), without its call
        counts[reason] = counts.get(reason, 0) + 1
        n, text_hashes = self.text(text)
        return ParsedRequest(dialect, body, raw, n, self.check_len(n, max_tokens), stream, text_hashes, None,
                             session, pin)

    def token_array(self, arr: np.ndarray | LazyIds, session: str | None) -> Sequence[int]:
        """Block hashes of a non-empty uint64 token-id array (or :class:`LazyIds`, parsed as far
        as hashing reads, and whole only when the vocabulary check needs every id)."""
        if self.vocab_size and (top := int(arr.max())) >= self.vocab_size:
            raise _bad(f"Token id {top} is out of vocabulary", "prompt")  # vLLM's words
        return self.hash_cache.hashes_array(arr, session)


class OpenAIDialect:
    """The answers of OpenAI's dialects: ``usage`` last, ``prompt_tokens_details.cached_tokens``."""

    path = ""
    error_body: ErrorBody | None = None  # vLLM's OpenAI error shape

    def __init__(self, prompts: Prompts):
        self.prompts = prompts

    def usage_of_answer(self, data: bytes) -> Usage | None:
        return self.prompts.usage.openai(data)

    def usage_of_stream(self, tail: bytes) -> Usage | None:
        return openai_usage(usage_from_tail(tail))

    @staticmethod
    def stream_complete(tail: bytes) -> bool:
        return tail.rstrip().endswith(b"[DONE]")

    def answered(self, req: ParsedRequest, target: int, data: bytes, streamed: bool) -> None:
        return None


class Completions(OpenAIDialect):
    """``POST /v1/completions``: a token-id prompt (routed exactly), or text (exactly with a
    tokenizer, else approximately). A body of :data:`~gateway.http.prompt.FAST_PARSE_MIN_BYTES` and
    more (with ``fast_ids``) has its flat id array read without building the ids as Python ints
    (:func:`gateway.http.prompt.fast_completion_ids`): from the prompt memo when the prompt repeats
    or extends one it holds, else by the token-id stage; any other body is parsed whole by orjson."""

    path = COMPLETIONS

    def __init__(self, prompts: Prompts, fast_ids: bool = True):
        super().__init__(prompts)
        self.fast_ids = fast_ids  # False: every body parsed whole by orjson (the reference)

    def parse(self, raw: bytes, session: str | None) -> ParsedRequest:
        p = self.prompts
        if self.fast_ids and len(raw) >= FAST_PARSE_MIN_BYTES and (
                fast := fast_completion_ids(raw, p.memo, session, p.ids)) is not None:
            body, arr = fast
            p.check_model(body)
            max_tokens, stream = p.options(body)
            hashes = p.token_array(arr, session)
            n = len(arr)
            return ParsedRequest(self, body, raw, n, p.check_len(n, max_tokens), stream, hashes, TokenIds(arr),
                                 session)
        body = p.body(raw)
        max_tokens, stream = p.options(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids: list[int] | None = None
            if p.tokenizer is not None:
                ids = p.tokenizer.completion_ids(prompt, body)
                hashes: Sequence[int] = p.exact(ids, session)
                n = len(ids)
            else:
                p.approximate("text: no tokenizer")
                n, hashes = p.text(prompt)
            return ParsedRequest(self, body, raw, n, p.check_len(n, max_tokens), stream, hashes, ids, session)
        if isinstance(prompt, list) and prompt and (packed := pack_token_ids(prompt)) is not None:
            arr = np.frombuffer(packed, dtype=np.uint64)
            if self.fast_ids and len(raw) >= FAST_PARSE_MIN_BYTES and prompt is body.get("prompt"):
                p.memo.learn(raw, session, arr)  # the next repeat or extension skips the parse
            hashes = p.token_array(arr, session)
            n = len(arr)
            return ParsedRequest(self, body, raw, n, p.check_len(n, max_tokens), stream, hashes, prompt, session)
        raise _bad("prompt must be a string or a non-empty list of non-negative token ids (one prompt)", "prompt")


class Chat(OpenAIDialect):
    """``POST /v1/chat/completions``: messages rendered and tokenized as vLLM does when the gateway
    has the engines' tokenizer and chat template, else routed by an approximate hash of their text."""

    path = CHAT

    def parse(self, raw: bytes, session: str | None) -> ParsedRequest:
        p = self.prompts
        body = p.body(raw)
        max_tokens, stream = p.options(
            body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list of objects", "messages")
        for m in messages:  # a loop: all() over a generator costs a frame per request
            if not isinstance(m, dict):
                raise _bad("messages must be a non-empty list of objects", "messages")
        if p.tokenizer is None:
            return p.approximated(self, body, raw, max_tokens, stream, session, "chat", chat_text(messages))
        return self._rendered(body, raw, max_tokens, stream, session, messages)

    def _rendered(self, body: dict[str, Any], raw: bytes, max_tokens: int, stream: bool, session: str | None,
                  messages: list[dict[str, Any]]) -> ParsedRequest:
        tok = self.prompts.tokenizer
        assert tok is not None
        return self.prompts.rendered(self, body, raw, max_tokens, stream, session, "chat",
                                     lambda: tok.chat_ids(body, session), lambda: chat_text(messages))


class RequestParser:
    """The gateway's dialects by path."""

    def __init__(self, dialects: Sequence[Dialect]):
        self.by_path: dict[str, Dialect] = {}
        for d in dialects:
            if d.path in self.by_path:
                raise ValueError(f"two dialects for {d.path}")
            self.by_path[d.path] = d

    def error_bodies(self) -> dict[str, ErrorBody]:
        """The endpoints whose API has an error shape of its own, and that shape."""
        return {path: d.error_body for path, d in self.by_path.items() if d.error_body is not None}

    def parse(self, endpoint: str, raw: bytes, session: str | None) -> ParsedRequest:
        """The :class:`ParsedRequest` of a POST to ``endpoint``; a GpuhitError for a bad one."""
        dialect = self.by_path.get(endpoint)
        if dialect is None:
            raise GpuhitError(f"no prompt dialect serves {endpoint}")
        return dialect.parse(raw, session)


# The dialects every gateway serves, each built from the gateway's Prompts.
DIALECTS: tuple[type[OpenAIDialect], ...] = (Completions, Chat)
# The agentic dialects (gateway.http.agentic) need the gateway's response history: built apart.
PROMPT_PATHS: tuple[str, ...] = (*(d.path for d in DIALECTS), MESSAGES, RESPONSES)
