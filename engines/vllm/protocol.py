"""vLLM's OpenAI-compatible wire shapes, shared by the emulated server, the vLLM adapter and the gateway.

Only what gpuhit sends or reads: completion / chat bodies and chunks, ``usage`` with
``prompt_tokens_details.cached_tokens``, SSE framing, and vLLM's error body
``{"error": {"message", "type", "param", "code"}}`` where ``code`` is the HTTP status (int) and
``type`` the exception class name vLLM uses (``BadRequestError``, ``NotFoundError``, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from gpuhit.errors import BadRequestError, GpuhitError, NotFoundError

SSE_DONE = b"data: [DONE]\n\n"

# vLLM names the error type after the HTTP class of the failure.
_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    413: "BadRequestError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_body(message: str, status: int, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_ or _TYPE_BY_STATUS.get(status, "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def error_from_exc(exc: GpuhitError) -> tuple[int, dict[str, Any]]:
    """(status, body) for one of our errors, in vLLM's shape."""
    status = int(getattr(exc, "http_status", 500))
    return status, error_body(str(exc), status, getattr(exc, "param", None), getattr(exc, "error_type", None))


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (vLLM's framing: ``data: ...\\n\\n``)."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    # vLLM fills prompt_tokens_details only when --enable-prompt-tokens-details is on; gpuhit's
    # emulator always does, since the replayer reads the realized hit from it.
    out["prompt_tokens_details"] = None if cached_tokens is None else {"cached_tokens": cached_tokens}
    return out


def cached_tokens_of(usage_obj: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` or None when the server did not report it."""
    # type(...) is dict first: parsed JSON is a dict, and isinstance against the Mapping ABC costs
    # more than the rest of this function.
    if type(usage_obj) is not dict and not isinstance(usage_obj, Mapping):
        return None
    details = usage_obj.get("prompt_tokens_details")
    if type(details) is not dict and not isinstance(details, Mapping):
        return None
    v = details.get("cached_tokens")
    return v if isinstance(v, int) else None


def completion_request(
    prompt_token_ids: list[int],
    max_tokens: int,
    model: str,
    stream: bool = True,
    kv_transfer_params: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The replay request: exact output length, token-id prompt, usage in the stream."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_token_ids,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    return body


def bad_request(message: str, param: str | None = None) -> BadRequestError:
    """A 400 error carrying vLLM's ``param`` field (the offending request field, if any)."""
    err = BadRequestError(message)
    err.param = param  # type: ignore[attr-defined]
    return err


def validation_error(field: str, msg: str, value: Any) -> BadRequestError:
    """A 400 for a field of the wrong type, shaped as vLLM's request-validation errors are (pydantic:
    type ``Bad Request``, param ``body.<field>``, a ``1 validation error:`` message)."""
    loc = f"body.{field}"
    err = BadRequestError(f"1 validation error:\n  {{'loc': '{loc}', 'msg': '{msg}', 'input': {str(value)[:50]!r}}}")
    err.param = loc  # type: ignore[attr-defined]
    err.error_type = "Bad Request"  # type: ignore[attr-defined]
    return err


def parse_body(raw: bytes, served_model: str, unknown_model_hint: str = "") -> dict[str, Any]:
    """The JSON object of an OpenAI request body, checked the way vLLM checks it: valid JSON, an
    object, and a ``model`` (when given) equal to the served one (else 404, vLLM's message plus
    ``unknown_model_hint``)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        err = bad_request(f"1 validation error:\n  request body is not valid JSON: {exc}")
        err.error_type = "Bad Request"  # type: ignore[attr-defined]
        raise err from None
    if not isinstance(body, dict):
        err = bad_request("1 validation error:\n  request body must be a JSON object (Input should be a valid dictionary)", "body")
        err.error_type = "Bad Request"  # type: ignore[attr-defined]
        raise err
    return check_model(body, served_model, unknown_model_hint)


def check_model(body: dict[str, Any], served_model: str, unknown_model_hint: str = "") -> dict[str, Any]:
    """``body`` when its ``model`` (if given) is the served one, else vLLM's 404 (see :func:`parse_body`)."""
    model = body.get("model")
    if model is not None and model != served_model:
        err = NotFoundError(f"The model `{model}` does not exist.{unknown_model_hint}")
        err.param = "model"  # type: ignore[attr-defined]
        raise err
    return body


def check_context_length(prompt_len: int, max_tokens: int, max_model_len: int | None,
                         max_tokens_param: str = "max_tokens") -> int:
    """The ``max_tokens`` vLLM 0.32 runs a request with, or its 400 when the request cannot run.

    vLLM's rule (``renderers/params.py`` ``TokenizeParams``, ``v1/engine/input_processor.py``,
    ``entrypoints/serve/utils/api_utils.py`` ``get_max_tokens``), in its order:
    ``max_tokens > max_model_len`` is refused; a prompt longer than ``max_model_len`` is refused; a
    prompt of exactly ``max_model_len`` tokens is refused (no room for one output token); otherwise
    ``max_tokens`` is clamped to ``max_model_len - prompt_len`` (not refused). Messages are vLLM's.
    ``max_model_len`` None = no limit known.
    """
    if max_model_len is None:
        return max_tokens
    if max_tokens > max_model_len:
        raise bad_request(f"{max_tokens_param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                          f"Please request fewer output tokens. (parameter={max_tokens_param}, value={max_tokens})",
                          max_tokens_param)
    if prompt_len > max_model_len:
        # vLLM's VLLMValidationError appends "(parameter=..., value=...)" to its message.
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. "
            f"Please reduce the length of the input prompt. (parameter=input_tokens, value={prompt_len})",
            "input_tokens")
    if prompt_len == max_model_len:
        raise bad_request(
            f"The decoder prompt (length {prompt_len}) plus the number of requested output tokens (at least 1) "
            f"is longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no "
            "smaller than the number of text tokens (prompt + requested output tokens).")
    left = max_model_len - prompt_len
    return max_tokens if max_tokens < left else left  # noqa: FURB136 - min() without its call (engines.base.max_cached_tokens)


def request_max_tokens(output_length: int, prompt_len: int, max_model_len: int | None) -> tuple[int, str]:
    """(max_tokens vLLM runs a turn with, record note) for a trace turn; raises vLLM's 400.

    vLLM refuses ``max_tokens`` 0 (``SamplingParams``: "max_tokens must be at least 1"), so a turn
    whose trace output length is 0 is sent with ``max_tokens`` 1 and the note says so; vLLM clamps
    ``max_tokens`` to the context left and refuses a prompt of >= ``max_model_len`` tokens
    (:func:`check_context_length`, a :class:`~gpuhit.errors.BadRequestError`).
    """
    want = max(output_length, 1)
    notes = [] if output_length >= 1 else [f"max_tokens 1: trace output {output_length} (vLLM refuses 0)"]
    got = check_context_length(prompt_len, want, max_model_len)
    if got < want:
        notes.append(f"max_tokens clamped {want} -> {got} (max_model_len {max_model_len})")
    return got, "; ".join(notes)
