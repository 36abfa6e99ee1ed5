"""The real-vLLM ground: the shipped tiny model serves token-id, text and chat requests, reports
cached prompt tokens per block of 32, and publishes its KV-event sources (vLLM 0.32's shape)."""

from __future__ import annotations

import json
import urllib.request


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_tiny_model_serves_and_reports_cached_tokens(real_vllm_pair):
    url = real_vllm_pair.urls[0]
    prompt = list(range(1000, 1100))  # 100 tokens = 3 full blocks of 32
    first = _post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    again = _post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert first["usage"]["prompt_tokens"] == 100
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    chat = _post(url + "/v1/chat/completions",
                 {"model": "tiny", "messages": [{"role": "user", "content": "route the query"}], "max_tokens": 2})
    assert chat["usage"]["completion_tokens"] == 2
    models = _get(url + "/v1/models")
    assert models["data"][0]["max_model_len"] == real_vllm_pair.max_model_len


def test_kv_event_sources_shape(real_vllm_pair):
    srv = real_vllm_pair.servers[1]
    sources = _get(srv.url + "/kv_event_sources")
    assert isinstance(sources, dict) and set(sources) == {"0"}
    assert sources["0"]["endpoint"] == f"tcp://*:{srv.kv_events_port}"
    assert sources["0"]["replay_endpoint"] == f"tcp://*:{srv.kv_events_port + 1}"
