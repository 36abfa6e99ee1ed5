"""A model directory's own tokenizer for the emulated server (``gpuhit emulate --tokenizer DIR``).

Reads ``tokenizer.json`` with the ``tokenizers`` library and the chat template from
``tokenizer_config.json`` (rendered with Jinja2), so text and chat prompts become the token ids vLLM
serving that directory computes: completions are encoded with the tokenizer's special tokens (vLLM's
``add_special_tokens=True``), chat prompts render the template with ``add_generation_prompt=True``
and are encoded without them (vLLM's chat default). ``vocab_size`` comes from the model's
``config.json`` when present (vLLM rejects token ids at or above it), else from the tokenizer.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from gpuhit.errors import BadRequestError, ConfigError


class HFTokenizer:
    """Text -> ids and chat messages -> ids, as vLLM does for the model in ``directory``."""

    def __init__(self, directory: str | pathlib.Path):
        d = pathlib.Path(directory)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs the `tokenizers` package (pip install 'gpuhit[tokenizer]')") from None
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"--tokenizer {d}: no tokenizer.json there")
        self.directory = d
        self._tok = Tokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._special = {k: cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        template = cfg.get("chat_template")
        self._template = None
        if template is not None:
            import jinja2

            env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)
        model_cfg = d / "config.json"
        vocab = json.loads(model_cfg.read_text()).get("vocab_size") if model_cfg.is_file() else None
        self.vocab_size = int(vocab or self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._template is None:
            raise BadRequestError(f"the tokenizer in {self.directory} has no chat_template")
        return self._template.render(messages=list(messages), add_generation_prompt=True, **self._special)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self._tok.encode(self.render_chat(messages), add_special_tokens=False).ids


def _raise(message: str) -> None:
    raise BadRequestError(message)
