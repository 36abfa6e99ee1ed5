"""Differential HTTP test of the agentic dialects: the same Anthropic Messages and OpenAI Responses
requests to `gpuhit emulate` and to real vLLM 0.32 (configured alike), compared on what clients
see: JSON keys and value types, event sequences, token counts, each dialect's prefix-hit field, the
stored-response routes and their errors.

Known differences, asserted as such: the emulator's text is " x" per token where the tiny model's
random weights decode to "" (so vLLM sends no content block, and an output message without text), and the
emulator renders tools into no prompt tokens of their own (its chat template has no tools).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from engines.vllm.venv import TINY_MODEL_DIR
from tests.e2e.helpers import spawn_emulator, sse_events
from tests.e2e.test_emulated_vs_vllm import _defaults_filled, shape

SYSTEM = "You are the gpuhit test agent: route every query to the engine holding its prefix. " * 3


def _call(base: str, method: str, path: str, body: Any = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {"content-type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _json(base, method, path, body=None):
    status, text = _call(base, method, path, body)
    return status, json.loads(text)


def _events(base, path, body) -> list[tuple[str, dict]]:
    status, text = _call(base, "POST", path, body)
    assert status == 200, text
    return sse_events(text)


@pytest.fixture(scope="module")
def ref_and_emu(real_vllm_pair):
    loop = asyncio.new_event_loop()
    proc, url = loop.run_until_complete(spawn_emulator(
        "--model", "tiny", "--tokenizer", str(TINY_MODEL_DIR), "--block-size", str(real_vllm_pair.block_size),
        "--max-model-len", str(real_vllm_pair.max_model_len), "--num-gpu-blocks", "4096", "--zero-cost"))
    try:
        yield real_vllm_pair.urls[1], url
    finally:
        loop.run_until_complete(proc.stop())
        loop.close()


def test_messages_match(ref_and_emu):
    ref, emu = ref_and_emu
    body = {"model": "tiny", "max_tokens": 3, "system": "messages " + SYSTEM,
            "messages": [{"role": "user", "content": "route the query"}]}
    for turn in range(2):  # the second sends the same prompt: a prefix hit on both
        (sr, r), (se, e) = _json(ref, "POST", "/v1/messages", body), _json(emu, "POST", "/v1/messages", body)
        assert sr == se == 200
        assert shape({**e, "content": None}) == shape({**r, "content": None})
        assert r["usage"] == e["usage"]
        assert (r["usage"]["cache_read_input_tokens"] > 0) == (turn == 1)
    assert r["content"] == [{"type": "text", "text": ""}] and e["content"] == [{"type": "text", "text": " x x x"}]
    ref_ev, emu_ev = (_events(u, "/v1/messages", {**body, "stream": True}) for u in (ref, emu))
    # vLLM's tiny model writes no text, so no content block: the message events must be alike
    emu_msg = [(k, d) for k, d in emu_ev if not k.startswith("content_block")]
    assert [k for k, _ in ref_ev] == [k for k, _ in emu_msg] == ["message_start", "message_delta", "message_stop"]
    for (_, a), (_, b) in zip(ref_ev, emu_msg):
        assert shape(a) == _defaults_filled(shape(b), shape(a))
    assert ref_ev[1][1]["usage"] == emu_msg[1][1]["usage"]
    assert ref_ev[0][1]["message"]["usage"] == emu_msg[0][1]["message"]["usage"]
    count = {k: v for k, v in body.items() if k != "max_tokens"}
    assert _json(ref, "POST", "/v1/messages/count_tokens", count) == _json(emu, "POST", "/v1/messages/count_tokens", count)
    missing = {**body, "model": "nope"}
    (sr, r), (se, e) = _json(ref, "POST", "/v1/messages", missing), _json(emu, "POST", "/v1/messages", missing)
    assert sr == se == 404 and shape(r) == shape(e) and r["type"] == e["type"] == "error"


def test_responses_match_and_chain(ref_and_emu):
    ref, emu = ref_and_emu
    body = {"model": "tiny", "max_output_tokens": 3, "instructions": "responses " + SYSTEM, "input": "route it"}
    (sr, r), (se, e) = _json(ref, "POST", "/v1/responses", body), _json(emu, "POST", "/v1/responses", body)
    assert sr == se == 200
    # the known difference: vLLM's output message holds no text (the tiny model's tokens decode to "")
    assert not [c for item in r["output"] for c in item.get("content", []) if c.get("text")]
    assert e["output"][0]["content"][0]["text"] == " x x x"
    assert shape({**e, "output": []}) == _defaults_filled(shape({**e, "output": []}), shape({**r, "output": []}))
    # the emulator never ends on EOS; vLLM's random weights may (no ignore_eos in the Responses API)
    assert r["usage"]["input_tokens"] == e["usage"]["input_tokens"] and e["status"] == "incomplete"
    assert r["usage"]["input_tokens_details"] == e["usage"]["input_tokens_details"]
    nxt = {**body, "input": "and then", "previous_response_id": None, "stream": True}
    got = {}
    for name, url, prev in (("ref", ref, r["id"]), ("emu", emu, e["id"])):
        got[name] = _events(url, "/v1/responses", {**nxt, "previous_response_id": prev})
    ref_kinds = [k for k, _ in got["ref"]]
    emu_kinds = [k for k, _ in got["emu"] if not k.startswith(("response.output", "response.content"))]
    assert ref_kinds == emu_kinds == ["response.created", "response.in_progress", "response.completed"]
    ru, eu = got["ref"][-1][1]["response"]["usage"], got["emu"][-1][1]["response"]["usage"]
    # The emulator continues from its stored messages plus its own (non-empty) output text, vLLM from
    # an empty output: the same stored prefix is cached on both.
    assert ru["input_tokens_details"]["cached_tokens"] == eu["input_tokens_details"]["cached_tokens"] > 0
    for url, rid in ((ref, r["id"]), (emu, e["id"])):
        status, doc = _json(url, "GET", f"/v1/responses/{rid}")
        assert status == 200 and doc["id"] == rid
    cancel = [_json(u, "POST", f"/v1/responses/{i}/cancel") for u, i in ((ref, r["id"]), (emu, e["id"]))]
    assert cancel[0] == cancel[1] and cancel[0][0] == 400
    gone = [_json(u, "POST", "/v1/responses", {**body, "previous_response_id": "resp_gone"}) for u in (ref, emu)]
    assert gone[0] == gone[1] and gone[0][0] == 404
    assert [_json(u, "GET", "/v1/responses/resp_gone") for u in (ref, emu)] == [gone[0]] * 2
