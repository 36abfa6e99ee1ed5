"""The emulated server's answers in vLLM 0.32's shapes: a finished request's body, one SSE chunk
per generated token, the usage block, and the ``kv_transfer_params`` a producer returns. Pure
functions of the engine's :class:`engines.base.GenerateResult`; the routes are
:mod:`engines.emulated.server`.
"""

from __future__ import annotations

from typing import Any

from engines.base import GenerateResult
from engines.vllm import protocol

TOKEN_TEXT = " x"  # the text of every generated token (the emulator has no vocabulary to sample)
SYSTEM_FINGERPRINT = "gpuhit-emulated"


def completion_body(head: dict[str, Any], res: GenerateResult, chat: bool) -> dict[str, Any]:
    """The body of a finished, successful non-streaming request (``head``: id, object, created,
    model), with the keys and null fields of vLLM 0.32's CompletionResponse / ChatCompletionResponse."""
    text = TOKEN_TEXT * res.completion_tokens
    out = dict(head)
    if chat:
        out["object"] = "chat.completion"
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "reasoning": None}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None, "token_ids": None, "routed_experts": None}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
    out["choices"] = [choice]
    out["service_tier"] = None
    out["system_fingerprint"] = SYSTEM_FINGERPRINT
    out["usage"] = usage(res, chat, unary=True)
    if chat:
        out.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    out["kv_transfer_params"] = returned_params(res)
    out["ec_transfer_params"] = None
    out["metrics"] = None
    return out


def usage(res: GenerateResult, chat: bool, unary: bool) -> dict[str, Any]:
    """The usage block of a non-streaming answer (``unary``) or of a stream's usage chunk."""
    # A PD consumer reports what it holds after the load (local + loaded tokens); vLLM 0.32 reports
    # the producer's `remote_prefill_cached_tokens` instead (README, "Emulator vs vLLM"): gpuhit's
    # transfer accounting reads the loaded tokens from here.
    u = protocol.usage(res.prompt_tokens, res.completion_tokens, cached_tokens(res))
    details = u["prompt_tokens_details"]
    # vLLM fills these per endpoint: chat reports created_cache_tokens 0, completions null; the
    # streaming usage chunk of a completion has cached_tokens only.
    if chat:
        details["created_cache_tokens"] = 0
    elif unary:
        details["created_cache_tokens"] = None
    if unary:
        details["multimodal_tokens"] = None
        u["completion_tokens_details"] = None
    return u


def cached_tokens(res: GenerateResult) -> int:
    # vLLM's prefill_stats.num_cached_tokens: local prefix-cache hits plus connector-loaded tokens.
    return res.cached_tokens + res.external_cached_tokens


def returned_params(res: GenerateResult) -> dict[str, Any] | None:
    """A producer's ``kv_transfer_params`` for the consumer, with vLLM 0.32's
    ``remote_prefill_cached_tokens`` (the producer's own cached tokens) added, as its
    scheduler adds them when a ``do_remote_decode`` request finishes."""
    if not res.kv_transfer_params:
        return None
    out = dict(res.kv_transfer_params)
    if out.get("do_remote_prefill"):
        out.setdefault("remote_prefill_cached_tokens", cached_tokens(res))
    return out


def chunk(head: dict[str, Any], chat: bool, finish: str | None, role: bool = False,
           fingerprint: bool = False) -> bytes:
    """One SSE chunk of one generated token (vLLM streams one per token); ``role``: chat's first
    chunk, which vLLM sends before any token with the role and empty content."""
    if chat:
        if role:
            choice: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}
            return protocol.sse({**head, "choices": [choice], "prompt_token_ids": None, "prompt_text": None})
        choice = {"index": 0, "delta": {"content": TOKEN_TEXT}, "logprobs": None, "finish_reason": finish,
                  "token_ids": None}
        if finish is not None:
            choice["stop_reason"] = None
    else:
        choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                  "prompt_token_ids": None, "token_ids": None}
    obj = {**head, "choices": [choice]}
    if fingerprint:  # vLLM's last chunk of a stream without a usage chunk
        obj["system_fingerprint"] = SYSTEM_FINGERPRINT
    return protocol.sse(obj)
