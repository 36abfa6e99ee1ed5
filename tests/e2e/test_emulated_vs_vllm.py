"""Differential HTTP test: the same requests to `gpuhit emulate` and to a real vLLM 0.32 (the session's
pair, configured alike: model "tiny" with its tokenizer, block 32, max_model_len 4096), compared on
what clients see: JSON keys and value types, one SSE chunk per token, `created`, ids, the models card,
the KV-event sources, the metric families, error bodies, the context-length rules and token counts.

Every difference that remains is asserted here as such (so a change on either side shows up) and
listed in the README's "Emulator vs vLLM, HTTP surface" section with its reason.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.vllm.venv import TINY_MODEL_DIR
from tests.e2e.helpers import spawn_emulator

P = list(range(20_000, 20_040))  # token ids no other real-vLLM test sends


def _call(base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None):
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data, {"content-type": "application/json", **(headers or {})},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _json(base, method, path, body=None, headers=None):
    status, text = _call(base, method, path, body, headers)
    return status, json.loads(text)


def _sse(base, path, body, headers=None):
    status, text = _call(base, "POST", path, body, headers)
    assert status == 200, text
    events = [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def shape(v: Any) -> Any:
    """The JSON value's structure: keys and value types (null kept apart from the rest)."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(x) for x in v[:1]]
    return "null" if v is None else type(v).__name__


def _runs(items: list[Any]) -> list[Any]:
    """``items`` with consecutive repeats collapsed."""
    return [x for i, x in enumerate(items) if i == 0 or x != items[i - 1]]


def _defaults_filled(emu: Any, ref: Any) -> Any:
    """``ref``'s shape with the emulator's non-null values standing where vLLM has null (a text,
    ``kv_transfer_params`` the emulator fills) or the reverse; everything else must be equal."""
    if isinstance(emu, dict) and isinstance(ref, dict):
        return {k: _defaults_filled(emu.get(k), ref[k]) for k in ref}
    return emu if "null" in (emu, ref) else ref


@pytest.fixture(scope="module")
def pair_and_emulator(real_vllm_pair):
    """(vLLM URL, emulator URL): one `gpuhit emulate` subprocess configured like the pair."""
    loop = asyncio.new_event_loop()
    proc, url = loop.run_until_complete(spawn_emulator(
        "--model", "tiny", "--tokenizer", str(TINY_MODEL_DIR), "--block-size", str(real_vllm_pair.block_size),
        "--max-model-len", str(real_vllm_pair.max_model_len), "--num-gpu-blocks", "4096", "--zero-cost"))
    try:
        yield real_vllm_pair.urls[0], url
    finally:
        loop.run_until_complete(proc.stop())
        loop.close()


def test_unary_completion_and_chat_bodies_match(pair_and_emulator):
    ref, emu = pair_and_emulator
    t0 = time.time()
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": P, "max_tokens": 3, "ignore_eos": True}),
                       ("/v1/chat/completions", {"model": "tiny", "max_tokens": 3, "ignore_eos": True,
                                                 "messages": [{"role": "user", "content": "route the query"}]})):
        (sr, r), (se, e) = _json(ref, "POST", path, body, {"X-Request-ID": "diff-1"}), \
            _json(emu, "POST", path, body, {"X-Request-ID": "diff-1"})
        assert sr == se == 200
        assert shape(e) == _defaults_filled(shape(e), shape(r)), path
        assert r["id"] == e["id"] == ("chatcmpl-diff-1" if "chat" in path else "cmpl-diff-1")
        assert t0 - 5 <= r["created"] <= time.time() + 5 and t0 - 5 <= e["created"] <= time.time() + 5
        # the same tokenizer and chat template: the same prompt length
        assert r["usage"]["prompt_tokens"] == e["usage"]["prompt_tokens"]
        assert r["usage"]["completion_tokens"] == e["usage"]["completion_tokens"] == 3
    # without X-Request-ID: random ids (unique across engines), in vLLM's form
    ids = [_json(u, "POST", "/v1/completions", {"prompt": P, "max_tokens": 1})[1]["id"] for u in (ref, emu, emu)]
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{16}", i) for i in ids) and len(set(ids)) == 3


def test_text_prompts_and_prefix_cache_hits_match(pair_and_emulator):
    ref, emu = pair_and_emulator
    out = {}
    for name, url in (("ref", ref), ("emu", emu)):
        first = _json(url, "POST", "/v1/completions", {"prompt": "hello world, route me", "max_tokens": 1})[1]
        prompt = list(range(21_000, 21_100))  # 100 tokens: 3 full blocks of 32
        _json(url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        again = _json(url, "POST", "/v1/completions", {"prompt": prompt + [7, 8], "max_tokens": 1})[1]
        out[name] = (first["usage"]["prompt_tokens"], again["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert out["ref"] == out["emu"] and out["emu"][1] == 96


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("usage", [False, True], ids=["no-usage", "usage"])
def test_streams_match_one_chunk_per_token(pair_and_emulator, chat, usage):
    ref, emu = pair_and_emulator
    n = 6
    body: dict[str, Any] = {"model": "tiny", "max_tokens": n, "ignore_eos": True, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hello there"}]
    else:
        path, body["prompt"] = "/v1/completions", P
    r, e = _sse(ref, path, body), _sse(emu, path, body)
    # vLLM sends one chunk per token, except that its output collector merges the tokens of steps
    # the HTTP writer has not picked up yet (2 busy cores: it happens); so the chunk shapes are
    # compared with repeats collapsed, and the per-token count is asserted on the emulator.
    assert _runs([shape(c) for c in e]) == _runs([shape(c) for c in r])
    tokens = len(e) - (1 if chat else 0) - (1 if usage else 0)
    assert tokens == n  # one chunk per generated token (chat: after vLLM's role chunk)
    assert len(r) - (1 if chat else 0) - (1 if usage else 0) <= n
    assert [c["choices"][0]["finish_reason"] for c in e if c["choices"]] == \
           [c["choices"][0]["finish_reason"] for c in r if c["choices"]]
    if usage:
        assert r[-1]["usage"]["prompt_tokens"] == e[-1]["usage"]["prompt_tokens"]


def test_models_card_and_kv_event_sources_match(pair_and_emulator):
    ref, emu = pair_and_emulator
    (_, r), (_, e) = _json(ref, "GET", "/v1/models"), _json(emu, "GET", "/v1/models")
    assert shape(e) == shape(r)
    rc, ec = r["data"][0], e["data"][0]
    for k in ("id", "object", "owned_by", "root", "parent", "max_model_len"):
        assert rc[k] == ec[k], k
    (_, r), (_, e) = _json(ref, "GET", "/kv_event_sources"), _json(emu, "GET", "/kv_event_sources")
    assert list(r) == list(e) == ["0"] and list(r["0"]) == list(e["0"])
    assert shape(e) == shape(r)
    assert r["0"]["endpoint"].startswith("tcp://*:") and e["0"]["endpoint"].startswith("tcp://127.0.0.1:")


def test_metric_families_are_vllms(pair_and_emulator):
    ref, emu = pair_and_emulator
    _json(emu, "POST", "/v1/completions", {"prompt": P, "max_tokens": 2})  # some non-zero counters
    fams = {}
    for name, url in (("ref", ref), ("emu", emu)):
        status, text = _call(url, "GET", "/metrics")
        assert status == 200
        fams[name] = {f.name: f for f in text_string_to_metric_families(text)}
    ref_f, emu_f = fams["ref"], fams["emu"]
    vllm_emu = {n: f for n, f in emu_f.items() if n.startswith("vllm:")}
    assert "vllm:prompt_tokens" in vllm_emu and "vllm:prefix_cache_hits" in vllm_emu
    for n, f in vllm_emu.items():
        assert n in ref_f, f"{n}: not a vLLM 0.32 metric"
        assert f.type == ref_f[n].type, n
        assert f.samples, f"{n}: an empty family"
        labels = {k for s in f.samples for k in s.labels}
        ref_labels = {k for s in ref_f[n].samples for k in s.labels}
        if n == "vllm:cache_config_info":
            assert labels <= ref_labels  # the emulator fills the labels gpuhit reads, vLLM many more
        else:
            assert labels == ref_labels, n
    # the `# TYPE` lines as prometheus_client renders counters (the `_total` form), on both sides
    for name, url in (("ref", ref), ("emu", emu)):
        text = _call(url, "GET", "/metrics")[1]
        assert "# TYPE vllm:prompt_tokens_total counter" in text, name
        assert "# TYPE vllm:time_to_first_token_seconds histogram" in text, name


BAD = [
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": P, "max_tokens": 3}, True),
    ("max_tokens < 1", "/v1/completions", {"prompt": P, "max_tokens": -1}, True),
    ("max_tokens not an int", "/v1/completions", {"prompt": P, "max_tokens": "x"}, False),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, True),
    ("empty prompt", "/v1/completions", {"prompt": [], "max_tokens": 3}, True),
    ("negative token id", "/v1/completions", {"prompt": [-1], "max_tokens": 3}, False),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [32_000], "max_tokens": 3}, True),
    ("prompt longer than max_model_len", "/v1/completions", {"prompt": list(range(1000, 5100)), "max_tokens": 3},
     True),
    ("kv_transfer_params not an object", "/v1/completions", {"prompt": P, "kv_transfer_params": 5}, False),
    ("no messages", "/v1/chat/completions", {"messages": [], "max_tokens": 3}, True),
    ("messages not a list", "/v1/chat/completions", {"messages": "x", "max_tokens": 3}, False),
]


@pytest.mark.parametrize(("case", "path", "body", "same_message"), BAD, ids=[b[0] for b in BAD])
def test_error_bodies_match(pair_and_emulator, case, path, body, same_message):
    ref, emu = pair_and_emulator
    (sr, r), (se, e) = _json(ref, "POST", path, body), _json(emu, "POST", path, body)
    assert sr == se and sr in (400, 404), (r, e)
    assert list(r) == list(e) == ["error"] and list(r["error"]) == list(e["error"])
    for k in ("type", "param", "code"):
        assert r["error"][k] == e["error"][k], (k, r, e)
    if same_message:
        assert r["error"]["message"] == e["error"]["message"]
    else:  # pydantic's detailed text (its error count varies with the field's union type)
        for m in (r, e):
            assert re.fullmatch(r"\d+ validation errors?:", m["error"]["message"].split("\n")[0])


def test_invalid_json_and_lax_booleans(pair_and_emulator):
    ref, emu = pair_and_emulator
    (sr, r), (se, e) = _json(ref, "POST", "/v1/completions", b"{not json"), \
        _json(emu, "POST", "/v1/completions", b"{not json")
    assert sr == se == 400 and r["error"]["type"] == e["error"]["type"] == "Bad Request"
    # pydantic's lax booleans: "yes" streams on both
    body = {"prompt": P, "max_tokens": 2, "ignore_eos": True, "stream": "yes"}
    assert len(_sse(ref, "/v1/completions", body)) == len(_sse(emu, "/v1/completions", body)) == 2


def test_context_length_clamps_max_tokens_like_vllm(pair_and_emulator):
    ref, emu = pair_and_emulator
    body = {"prompt": list(range(1000, 5000)), "max_tokens": 200, "ignore_eos": True}
    (sr, r), (se, e) = _json(ref, "POST", "/v1/completions", body), _json(emu, "POST", "/v1/completions", body)
    assert sr == se == 200
    assert r["usage"]["completion_tokens"] == e["usage"]["completion_tokens"] == 96  # 4096 - 4000
    assert r["choices"][0]["finish_reason"] == e["choices"][0]["finish_reason"] == "length"


def test_known_differences(pair_and_emulator):
    """What the emulator does differently on purpose (README, "Emulator vs vLLM, HTTP surface")."""
    ref, emu = pair_and_emulator
    for opt in ({"n": 2}, {"logprobs": 1}, {"echo": True}, {"best_of": 2}):
        # (ids the tiny tokenizer can decode: vLLM's echo detokenizes the prompt)
        body = {"prompt": list(range(1000, 1040)), "max_tokens": 2, **opt}
        assert _json(ref, "POST", "/v1/completions", body)[0] == 200
        status, err = _json(emu, "POST", "/v1/completions", body)
        assert status == 400 and err["error"]["param"] == next(iter(opt))  # refused, never ignored
    batch = {"prompt": [P, P], "max_tokens": 1}
    assert _json(ref, "POST", "/v1/completions", batch)[0] == 200
    assert _json(emu, "POST", "/v1/completions", batch)[0] == 400  # one prompt per request
    # vLLM serves /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (engines.vllm.launch sets it, so
    # experiments start cold); the emulator always
    assert _call(ref, "POST", "/reset_prefix_cache")[0] == 200
    assert _json(emu, "POST", "/reset_prefix_cache")[0] == 200
