"""The gateway renders chat, Anthropic Messages and OpenAI Responses requests to exactly the token ids
vLLM runs: generated multi-turn conversations (system blocks, tools, tool calls and results,
reasoning, developer messages, custom and namespaced tools, billing headers, inline system
reminders) against real vLLM's own render routes. The count and the mismatches are printed."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from engines.vllm.venv import TINY_MODEL_DIR
from gateway.dialects.render import DialectRenderer
from gateway.tokenizer import PromptTokenizer
from tests.e2e.agentic_conversations import requests

ROUTES = {"chat": "/v1/chat/completions/render", "messages": "/v1/messages/render",
          "responses": "/v1/responses/render"}
CONVERSATIONS = 40  # per dialect: ~430 requests, each rendered by vLLM in milliseconds


def _render(url: str, body: dict) -> list[int]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["token_ids"]
    except urllib.error.HTTPError as e:
        raise AssertionError(f"vLLM refused {json.dumps(body)[:300]}: {e.read()[:300]!r}") from None


def test_dialects_render_as_vllm_renders(real_vllm_pair):
    url = real_vllm_pair.urls[0]
    tok = PromptTokenizer(TINY_MODEL_DIR)
    dialects = DialectRenderer(tok)
    ours = {"chat": tok.chat_ids, "messages": dialects.messages_ids,
            "responses": lambda b, s: dialects.responses_ids(b, s)[0]}
    counts, mismatches = {}, []
    for kind, route in ROUTES.items():
        convs = requests(kind, CONVERSATIONS)
        counts[kind] = (len(convs), sum(len(c) for c in convs))
        for ci, conv in enumerate(convs):
            for body in conv:
                # The session key makes the tokenizer reuse the previous turn's ids, as the gateway does.
                mine = ours[kind](body, f"{kind}-{ci}")
                if mine != _render(url + route, body):
                    mismatches.append((kind, ci, json.dumps(body)[:400]))
    print(f"render equality: {counts} (conversations, requests); mismatches: {len(mismatches)}")
    assert all(n > 0 for _, n in counts.values())
    assert mismatches == []
