"""Messages and Responses requests converted as vLLM converts them (the shapes its code writes), the
session each names, and the stored-response history. The full check against vLLM's own render
routes is tests/e2e/test_agentic_render.py."""

from __future__ import annotations

import json

import pytest

from engines.vllm.chat_messages import NotExact, conversation, tool_dict
from engines.vllm.dialects import anthropic, responses
from gateway.dialects import sessions
from gateway.dialects.history import ResponseHistory
from gpuhit.errors import BadRequestError


def test_anthropic_blocks_become_vllms_chat_messages():
    body = {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "be "},
                   {"type": "text", "text": "brief"}],
        "tools": [{"name": "read", "input_schema": {"properties": {}}}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                         {"type": "text", "text": "go on"}]},
            {"role": "system", "content": "reminder"},
        ],
    }
    chat = anthropic.to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning": "hm",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "a\nb"},  # before the user's own text
        {"role": "user", "content": "go on"},
        {"role": "system", "content": "reminder"},
    ]
    assert tool_dict(chat["tools"][0]) == {"type": "function", "function": {
        "name": "read", "description": None, "parameters": {"properties": {}, "type": "object"}}}
    merged = anthropic.to_chat(body, merge_inline_system=True)["messages"]
    assert merged[0] == {"role": "system", "content": "be briefreminder"} and merged[-1]["role"] == "user"


def test_anthropic_images_are_not_exact_and_bad_blocks_are_400():
    img = {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
    with pytest.raises(NotExact):
        anthropic.to_chat({"messages": [img]})
    with pytest.raises(BadRequestError):
        anthropic.to_chat({"messages": [{"role": "user", "content": [{"type": "video"}]}]})
    with pytest.raises(BadRequestError):
        anthropic.to_chat({"messages": []})


def test_chat_messages_as_the_template_sees_them():
    conv = conversation([
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]},
        {"role": "system", "content": "late"},
    ], template="{{ messages }}")
    assert conv[0] == {"role": "system", "content": "dev\n\nlate"}  # developer -> system, merged in front
    assert conv[1] == {"role": "user", "content": "a\nb"}
    assert conv[2]["content"] == "" and conv[2]["tool_calls"][0]["function"]["arguments"] == {}


def test_responses_items_become_vllms_chat_messages():
    body = {"instructions": "sys", "tools": [{"type": "custom", "name": "patch"},
                                             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]},
                                             {"type": "web_search"}],
            "input": [{"role": "user", "content": "hi"},
                      {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
                      {"type": "function_call", "call_id": "c1", "name": "f", "namespace": "ns", "arguments": "{}"},
                      {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "diff"},
                      {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}
    chat = responses.to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "reasoning": "r", "tool_calls": [
            {"id": "c1", "function": {"name": "ns__f", "arguments": "{}"}, "type": "function"},
            {"id": "c2", "function": {"name": "patch", "arguments": json.dumps({"input": "diff"})}, "type": "function"}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
    ]
    assert [t["function"]["name"] for t in chat["tools"]] == ["patch", "ns__f"]
    with pytest.raises(NotExact):
        responses.to_chat({"input": "x", "previous_response_id": "resp_1"})


def test_history_chains_messages_and_engines():
    h = ResponseHistory(max_entries=2)
    first = responses.to_chat({"instructions": "sys", "input": "q1"})
    h.record("resp_1", "e0", first["messages"], {"output": [
        {"type": "reasoning", "summary": []},
        {"type": "message", "content": [{"type": "output_text", "text": "a1"}]}]})
    assert h.engine_of("resp_1") == "e0" and h.session_of("resp_1") == "resp_1"
    second = responses.to_chat({"input": "q2", "previous_response_id": "resp_1"}, h.messages_after("resp_1"))
    assert second["messages"] == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                  {"role": "user", "content": "q2"}]
    h.record("resp_2", "e0", second["messages"], {"output": []}, session=h.session_of("resp_1"))
    h.record("resp_3", "e1", None, None)
    assert h.engine_of("resp_1") is None  # bounded: the oldest went
    assert h.session_of("resp_2") == "resp_1" and h.messages_after("resp_3") is None
    assert h.forget_engine("e0") == 1 and len(h) == 1


def test_sessions_from_headers_and_bodies():
    assert sessions.anthropic_session({"x-claude-code-session-id": "cc"}, {"metadata": {"user_id": "u"}}) == "cc"
    assert sessions.anthropic_session({}, {"metadata": {"user_id": "u"}}) == "u"
    assert sessions.responses_session({}, {"prompt_cache_key": "k"}) == "k"
    assert sessions.responses_session({}, {"conversation": {"id": "conv"}}) == "conv"
    assert sessions.responses_session({}, {"previous_response_id": "r"}, {"r": "s"}.get) == "s"
    assert sessions.responses_session({"session_id": "codex"}, {"prompt_cache_key": "k"}) == "codex"
    assert sessions.from_headers({}) is None
