"""The emulated server's reading of a request body: the stand-in tokenizer and chat template used
when no model tokenizer is given, and vLLM's checks of the fields it takes (pydantic's lax ints and
bools, and a 400 for options the emulator cannot honour rather than silently ignoring them).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from typing import Any

from engines.vllm import protocol

VOCAB = 151_936  # Qwen's vocabulary size; any size > 256 works
_PIECES = re.compile(r"\s*\S+|\s+$")


def simple_tokenize(text: str, vocab: int = VOCAB) -> list[int]:
    """Deterministic, prefix-stable stand-in tokenizer (see the module docstring)."""
    span = vocab - 256
    return [256 + zlib.crc32(p.encode()) % span for p in _PIECES.findall(text)]


def chat_template(messages: list[Mapping[str, Any]]) -> str:
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then the assistant header
    (ChatML, as Qwen models use). List contents keep their ``text`` parts, in order."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        parts.append(f"<|im_start|>{m.get('role')}\n{content or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


_bad = protocol.bad_request
_invalid = protocol.validation_error

# Options vLLM honours that the emulator cannot (it has no logits and one sequence per request):
# refused with a 400 instead of silently ignored. A value equal to the default is accepted.
_UNSUPPORTED: dict[str, Any] = {
    "n": 1, "best_of": None, "logprobs": None, "top_logprobs": None, "prompt_logprobs": None, "echo": False,
    "use_beam_search": False, "suffix": None, "response_format": None, "tools": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None, "prompt_embeds": None,
}
# pydantic's lax bool parsing, which vLLM's request models use ("yes" -> True).
_TRUE = {"true", "1", "yes", "y", "on", "t"}
_FALSE = {"false", "0", "no", "n", "off", "f"}


def int_field(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise _invalid(name, "Input should be a valid integer", v)
    if v < minimum:
        raise _bad(f"{name} must be at least {minimum}, got {v}. (parameter={name}, value={v})", name)
    return v


def bool_field(body: Mapping[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None or isinstance(v, bool):
        return bool(v)
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    raise _invalid(name, "Input should be a valid boolean", v)


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, default in _UNSUPPORTED.items():
        v = body.get(name, default)
        if v is not None and v != default and not (name == "logprobs" and v is False):
            raise _bad(f"the emulated engine does not support {name}={v!r} (no logits, one sequence per "
                       f"request); leave it out", name)
