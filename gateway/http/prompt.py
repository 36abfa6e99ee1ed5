"""From a request body to what routing needs: prompt length and block hashes.

* **Token-id prompts** (the replayer, any client sending ids): exact vLLM block hashes through
  :class:`engines.hashing.BlockHasher`, memoized per session. Agentic turn k+1 extends turn k, so
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
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

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
