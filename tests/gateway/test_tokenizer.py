"""Chat and text prompts tokenized as vLLM does (template in transformers' jinja environment, then
``add_special_tokens`` False for chat, True for completions), checked against transformers itself in
the vLLM venv (skipped without it) on the shipped tiny model."""

from __future__ import annotations

import json
import subprocess

import pytest

from engines.vllm.venv import TINY_MODEL_DIR, vllm_python
from gateway.tokenizer import NotExact, PromptTokenizer, discover
from gpuhit.errors import BadRequestError, ConfigError

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

CHATS = [
    [{"role": "user", "content": "route the query, not the cache"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo wörld 🙂"},
     {"role": "assistant", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]}],
]
TEXTS = ["The gateway routes every request", "  leading spaces and <|user|> specials\n"]


def _tok() -> PromptTokenizer:
    return PromptTokenizer(TINY_MODEL_DIR)


def test_chat_template_rendered_like_transformers():
    tok = _tok()
    text = tok.render_chat({"messages": CHATS[0]})
    assert text == "<|user|>\nroute the query, not the cache<|end|>\n<|assistant|>\n"
    assert tok.render_chat({"messages": CHATS[0], "add_generation_prompt": False}).endswith("<|end|>\n")
    assert tok.render_chat({"messages": CHATS[1]}).count("a\nb") == 1


def test_ids_equal_transformers_in_the_vllm_venv():
    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM venv")
    script = r'''
import json, sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
chats, texts = json.loads(sys.argv[2]), json.loads(sys.argv[3])
norm = lambda m: {**m, "content": m["content"] if isinstance(m["content"], str) else "\n".join(p["text"] for p in m["content"])}
out = {"chat": [tok.encode(tok.apply_chat_template([norm(m) for m in c], tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False) for c in chats],
       "text": [tok.encode(t) for t in texts]}
print(json.dumps(out))
'''
    try:
        proc = subprocess.run([str(py), "-c", script, str(TINY_MODEL_DIR), json.dumps(CHATS), json.dumps(TEXTS)],
                              capture_output=True, text=True, check=True, timeout=300)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"transformers reference failed: {exc.stderr[-2000:]}")
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    tok = _tok()
    assert [tok.chat_ids({"messages": c}) for c in CHATS] == ref["chat"]
    assert [tok.completion_ids(t, {}) for t in TEXTS] == ref["text"]


def test_what_cannot_be_exact_says_why():
    tok = _tok()
    with pytest.raises(NotExact, match="continue_final_message"):
        tok.chat_ids({"messages": CHATS[0], "continue_final_message": True})
    with pytest.raises(NotExact, match="content parts"):
        tok.chat_ids({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(BadRequestError, match="add_special_tokens"):
        tok.completion_ids("x", {"add_special_tokens": "yes"})


def test_discover_and_bad_sources(tmp_path):
    assert discover([None, "tiny", str(tmp_path), str(TINY_MODEL_DIR)]) == str(TINY_MODEL_DIR)
    assert discover(["Qwen/Qwen3"]) is None
    with pytest.raises(ConfigError, match="tokenizer.json"):
        PromptTokenizer(tmp_path)


def test_incremental_chat_tokenization_equals_full_and_skips_the_history():
    tok = _tok()
    msgs: list[dict] = [{"role": "system", "content": "sys <|end|> inside content too"}]
    for t in range(8):
        msgs = msgs + [{"role": "user", "content": f"turn {t}: " + "word " * (20 + 7 * t) + "héllo"}]
        body = {"messages": list(msgs)}
        before = tok.tokens_encoded
        got = tok.chat_ids(body, session="s")
        full = tok.encode(tok.render_chat(body), add_special_tokens=False)
        assert got == full, t
        if t:
            # only the tail after the last reused special token is tokenized again
            assert tok.tokens_encoded - before < len(full) // 2 + 40, t
        msgs = msgs + [{"role": "assistant", "content": f"reply {t}"}]
    # another conversation under the same key, and an edited history: still exact
    other = {"messages": [{"role": "user", "content": "different"}]}
    assert tok.chat_ids(other, session="s") == tok.encode(tok.render_chat(other), add_special_tokens=False)
    edited = {"messages": [{"role": "system", "content": "sys changed"}, *msgs[1:]]}
    assert tok.chat_ids(edited, session="s") == tok.encode(tok.render_chat(edited), add_special_tokens=False)
