"""Generated agentic conversations in the three chat dialects (chat completions, Anthropic Messages,
OpenAI Responses): many shapes, multi-turn, with tools, each turn a full request resending the
history. Used to check the gateway's rendering against vLLM's own render routes."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

WORDS = ("route", "the", "query", "to", "engine", "holding", "its", "prefix", "cache", "session", "tool", "result",
         "file", "read", "write", "patch", "test", "build", "gateway", "block", "token", "hit", "miss", "load")


def _text(rng: random.Random, lo: int = 3, hi: int = 30) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), rng.choice(["\n", "  ", "ünïcødé", '"quoted"', "<tag>", "{json}"]))
    return " ".join(words)


def _schema(rng: random.Random) -> dict[str, Any]:
    props = {f"arg{i}": {"type": rng.choice(["string", "integer"]), "description": _text(rng, 1, 4)}
             for i in range(rng.randint(0, 3))}
    s: dict[str, Any] = {"properties": props, "required": sorted(props)[:1]}
    if rng.random() < 0.7:
        s["type"] = "object"
    return s


def _args(rng: random.Random) -> dict[str, Any]:
    return {f"arg{i}": rng.choice([_text(rng, 1, 3), rng.randint(0, 99), [1, 2], {"k": "v"}]) for i in range(rng.randint(0, 3))}


# ------------------------------------------------------------------------------------- Messages

def messages_conversation(rng: random.Random, cid: int) -> Iterator[dict[str, Any]]:
    """Successive ``/v1/messages`` bodies of one conversation."""
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "messages": []}
    r = rng.random()
    if r < 0.3:
        body["system"] = _text(rng)
    elif r < 0.6:
        blocks = [{"type": "text", "text": _text(rng)} for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.5:
            blocks.insert(0, {"type": "text", "text": f"x-anthropic-billing-header: cc_version=1; cch={cid}"})
        body["system"] = blocks
    tools = []
    if rng.random() < 0.6:
        tools = [{"name": f"tool_{i}", "input_schema": _schema(rng)} | ({"description": _text(rng, 2, 8)}
                 if rng.random() < 0.7 else {}) for i in range(rng.randint(1, 3))]
        body["tools"] = tools
        body["tool_choice"] = {"type": "none"}  # the test engines run without a tool-call parser
    if rng.random() < 0.2:
        body["output_config"] = {"effort": rng.choice(["low", "high"])}
    r = rng.random()
    if r < 0.15:
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
        body["max_tokens"] = 2048  # vLLM wants the budget below max_tokens
    elif r < 0.25:
        body["thinking"] = {"type": "disabled"}
    if rng.random() < 0.3:
        body["metadata"] = {"user_id": f"user_{cid}_session_{cid}"}
    msgs = body["messages"]
    n = 0
    for _turn in range(rng.randint(1, 5)):
        user: Any = _text(rng) if rng.random() < 0.5 else [{"type": "text", "text": _text(rng)}
                                                           for _ in range(rng.randint(1, 2))]
        if rng.random() < 0.15:
            msgs.append({"role": "system", "content": "<reminder> " + _text(rng, 2, 6)})
        msgs.append({"role": "user", "content": user})
        yield _copy(body)
        blocks: list[dict[str, Any]] = []
        if rng.random() < 0.3:
            blocks.append({"type": "thinking", "thinking": _text(rng), "signature": "sig"})
        if rng.random() < 0.1:
            blocks.append({"type": "redacted_thinking", "data": "opaque"})
        if rng.random() < 0.7:
            blocks.append({"type": "text", "text": _text(rng)})
        calls = []
        if tools and rng.random() < 0.6:
            for _ in range(rng.randint(1, 2)):
                n += 1
                calls.append(f"toolu_{cid}_{n}")
                blocks.append({"type": "tool_use", "id": calls[-1], "name": rng.choice(tools)["name"],
                               "input": _args(rng)})
        msgs.append({"role": "assistant", "content": blocks if blocks and rng.random() < 0.9 else _text(rng)})
        if calls:
            results: list[dict[str, Any]] = []
            for c in calls:
                content: Any = _text(rng) if rng.random() < 0.5 else [{"type": "text", "text": _text(rng)}
                                                                      for _ in range(rng.randint(1, 2))]
                results.append({"type": "tool_result", "tool_use_id": c, "content": content}
                               | ({"is_error": True} if rng.random() < 0.1 else {}))
            if rng.random() < 0.4:
                results.append({"type": "text", "text": _text(rng)})
            msgs.append({"role": "user", "content": results})
            yield _copy(body)
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": _text(rng)}]})


# ------------------------------------------------------------------------------------ Responses

def responses_conversation(rng: random.Random, cid: int) -> Iterator[dict[str, Any]]:
    """Successive ``/v1/responses`` bodies of one conversation (the history resent as items)."""
    body: dict[str, Any] = {"model": "tiny", "max_output_tokens": 8, "store": False}
    if rng.random() < 0.6:
        body["instructions"] = _text(rng)
    tools: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        for i in range(rng.randint(1, 3)):
            kind = rng.choice(["function", "function", "custom", "namespace"])
            if kind == "function":
                tools.append({"type": "function", "name": f"fn_{i}", "parameters": _schema(rng),
                              "strict": rng.choice([None, False])} | ({"description": _text(rng, 2, 6)}
                                                                      if rng.random() < 0.7 else {}))
            elif kind == "custom":
                tools.append({"type": "custom", "name": f"custom_{i}", "description": _text(rng, 2, 6)})
            else:
                tools.append({"type": "namespace", "name": f"ns{i}", "description": "ns",
                              "tools": [{"type": "function", "name": "inner", "parameters": _schema(rng)}]})
        body["tools"] = tools
        body["tool_choice"] = "none"  # the test engines run without a tool-call parser
    if rng.random() < 0.2:
        body["reasoning"] = {"effort": rng.choice(["low", "medium"])}
    if rng.random() < 0.2:
        body["input"] = _text(rng)
        yield _copy(body)
        return
    items: list[dict[str, Any]] = []
    body["input"] = items
    if rng.random() < 0.2:
        items.append({"role": "developer", "content": _text(rng)})
    n = 0
    for _turn in range(rng.randint(1, 4)):
        if rng.random() < 0.5:
            items.append({"role": "user", "content": _text(rng)})
        else:
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": _text(rng)} for _ in range(rng.randint(1, 2))]})
        yield _copy(body)
        if rng.random() < 0.3:
            items.append({"type": "reasoning", "summary": [] if rng.random() < 0.5 else [
                {"type": "summary_text", "text": _text(rng)}],
                "content": [{"type": "reasoning_text", "text": _text(rng)}]})
        if rng.random() < 0.8:
            if rng.random() < 0.5:
                items.append({"type": "message", "role": "assistant", "status": "completed",
                              "content": [{"type": "output_text", "text": _text(rng), "annotations": []}]})
            else:
                items.append({"role": "assistant", "content": _text(rng)})
        callable_tools = [t for t in tools if t["type"] in ("function", "custom")]
        if callable_tools and rng.random() < 0.6:
            calls = []
            for _ in range(rng.randint(1, 2)):
                n += 1
                t = rng.choice(callable_tools)
                calls.append(f"call_{cid}_{n}")
                if t["type"] == "function":
                    import json
                    items.append({"type": "function_call", "call_id": calls[-1], "name": t["name"],
                                  "arguments": json.dumps(_args(rng))})
                else:
                    items.append({"type": "custom_tool_call", "call_id": calls[-1], "name": t["name"],
                                  "input": _text(rng)})
            for c in calls:
                items.append({"type": "function_call_output", "call_id": c, "output": _text(rng)})
            yield _copy(body)


# ----------------------------------------------------------------------------------------- chat

def chat_conversation(rng: random.Random, cid: int) -> Iterator[dict[str, Any]]:
    """Successive ``/v1/chat/completions`` bodies with tools, tool calls and null contents."""
    import json

    body: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "messages": []}
    msgs = body["messages"]
    if rng.random() < 0.5:
        msgs.append({"role": rng.choice(["system", "developer"]), "content": _text(rng)})
    tools = []
    if rng.random() < 0.6:
        tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": _schema(rng)}
                  | ({"description": _text(rng, 2, 5)} if rng.random() < 0.5 else {})} for i in range(rng.randint(1, 2))]
        body["tools"] = tools
        body["tool_choice"] = "none"  # the test engines run without a tool-call parser
    for turn in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": _text(rng) if rng.random() < 0.6 else
                     [{"type": "text", "text": _text(rng)} for _ in range(2)]})
        yield _copy(body)
        if tools and rng.random() < 0.5:
            cid_ = f"call_{cid}_{turn}"
            msgs.append({"role": "assistant", "content": None if rng.random() < 0.5 else _text(rng),
                         "tool_calls": [{"id": cid_, "type": "function", "function": {
                             "name": tools[0]["function"]["name"],
                             "arguments": rng.choice([json.dumps(_args(rng)), "", "not json"])}}]})
            msgs.append({"role": "tool", "tool_call_id": cid_, "content": _text(rng)})
            yield _copy(body)
        msgs.append({"role": "assistant", "content": _text(rng)}
                    | ({"reasoning": _text(rng)} if rng.random() < 0.3 else {}))


def _copy(body: dict[str, Any]) -> dict[str, Any]:
    import copy

    return copy.deepcopy(body)


def requests(kind: str, conversations: int, seed: int = 0) -> list[list[dict[str, Any]]]:
    """``conversations`` generated conversations of ``kind`` (chat | messages | responses), each
    the list of its successive request bodies."""
    gen = {"chat": chat_conversation, "messages": messages_conversation, "responses": responses_conversation}[kind]
    rng = random.Random(f"{kind}-{seed}")
    return [list(gen(rng, i)) for i in range(conversations)]
