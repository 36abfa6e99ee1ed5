"""Benchmark: gateway CPU per request of an Anthropic Messages or OpenAI Responses call against a
chat call of the same prompt (target: within 1.2x).

What differs between the dialects in the gateway is the parse (convert, render, tokenize, hash) and
the usage read of the answer; routing, forwarding and settling are the same code. This measures
those per request, in process, with the engines' tokenizer (the tiny model's) on agentic sessions:
each session resends its growing history every turn (a system prompt, tools, tool calls and
results), the same conversation written in each dialect. Prints CPU-us per request by dialect and
the ratios. Run: `pytest -s tests/perf/test_agentic_parse_cpu.py` (GPUHIT_BENCH_SCALE for fewer).
"""

from __future__ import annotations

import json
import os
import time

from engines.hashing import BlockHasher, SessionHashCache
from engines.vllm.venv import TINY_MODEL_DIR
from gateway.dialects.history import ResponseHistory
from gateway.http.agentic import Messages, Responses
from gateway.http.parse import Chat, Prompts
from gateway.tokenizer import PromptTokenizer

SCALE = float(os.environ.get("GPUHIT_BENCH_SCALE", "1"))
SESSIONS, TURNS = max(2, int(20 * SCALE)), 12
SYSTEM = "You are a coding agent working in the gpuhit repository. Follow the instructions. " * 40
TOOL = {"name": "read_file", "description": "Read a file.", "schema": {"type": "object", "properties": {
    "path": {"type": "string"}}, "required": ["path"]}}


def conversations(s: int, t: int) -> dict[str, bytes]:
    """Turn ``t`` of session ``s`` as the three dialects' request bodies."""
    chat = [{"role": "system", "content": SYSTEM}]
    msgs: list[dict] = []
    items: list[dict] = []
    for k in range(t + 1):
        user = f"session {s} turn {k}: read the file and fix the failing test. " * 6
        chat.append({"role": "user", "content": user})
        msgs.append({"role": "user", "content": user})
        items.append({"role": "user", "content": user})
        if k < t:
            args = json.dumps({"path": f"src/f{k}.py"})
            result = f"contents of src/f{k}.py " * 30
            chat += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": f"c{k}", "type": "function", "function": {"name": "read_file", "arguments": args}}]},
                {"role": "tool", "tool_call_id": f"c{k}", "content": result}]
            msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"c{k}", "name": "read_file",
                                                       "input": {"path": f"src/f{k}.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"c{k}", "content": result}]}]
            items += [{"type": "function_call", "call_id": f"c{k}", "name": "read_file", "arguments": args},
                      {"type": "function_call_output", "call_id": f"c{k}", "output": result}]
    tools_chat = [{"type": "function", "function": {"name": TOOL["name"], "description": TOOL["description"],
                                                    "parameters": TOOL["schema"]}}]
    return {
        "chat": json.dumps({"model": "tiny", "max_tokens": 8, "messages": chat, "tools": tools_chat}).encode(),
        "messages": json.dumps({"model": "tiny", "max_tokens": 8, "system": SYSTEM, "messages": msgs[:-1] + [
            msgs[-1]], "tools": [{"name": TOOL["name"], "description": TOOL["description"],
                                 "input_schema": TOOL["schema"]}]}).encode(),
        "responses": json.dumps({"model": "tiny", "max_output_tokens": 8, "instructions": SYSTEM, "input": items,
                                 "store": False, "tools": [{"type": "function", "name": TOOL["name"],
                                                           "description": TOOL["description"],
                                                           "parameters": TOOL["schema"]}]}).encode(),
    }


def test_agentic_parse_cpu_vs_chat():
    out = {}
    for kind in ("chat", "messages", "responses"):
        tok = PromptTokenizer(TINY_MODEL_DIR)
        prompts = Prompts("tiny", SessionHashCache(BlockHasher(32, "sha256")), 32, tokenizer=tok,
                          max_model_len=1 << 20)
        dialect = Chat(prompts) if kind == "chat" else Messages(prompts) if kind == "messages" else \
            Responses(prompts, ResponseHistory(), ["e0"])
        bodies = [[conversations(s, t)[kind] for t in range(TURNS)] for s in range(SESSIONS)]
        n = 0
        lengths = []
        t0 = time.process_time()
        for t in range(TURNS):  # sessions interleaved, turn by turn, as agents' traffic is
            for s in range(SESSIONS):
                req = dialect.parse(bodies[s][t], f"{kind}-{s}")
                lengths.append(req.prompt_tokens)
                n += 1
        out[kind] = ((time.process_time() - t0) / n * 1e6, sum(lengths) / n)
        assert prompts.not_exact == {}, prompts.not_exact
    chat_us = out["chat"][0]
    print(f"\nagentic parse CPU per request ({SESSIONS} sessions x {TURNS} turns, tiny tokenizer):")
    for kind, (us, tokens) in out.items():
        print(f"  {kind:10s} {us:9.1f} us/request  (mean prompt {tokens:.0f} tokens)  {us / chat_us:.2f}x chat")
