"""Text and chat prompts to token ids exactly as vLLM makes them, without transformers.

vLLM (0.32, ``vllm/renderers/hf.py`` + transformers' ``apply_chat_template``) turns a chat request
into ids in two steps:

1. render the model's chat template (``tokenizer_config.json`` ``chat_template``, or a
   ``chat_template.jinja`` beside it) with jinja2's ``ImmutableSandboxedEnvironment(trim_blocks=True,
   lstrip_blocks=True, extensions=[loopcontrols])``, the ``tojson`` filter without HTML escaping,
   ``raise_exception`` and ``strftime_now`` globals, the tokenizer's special tokens (``bos_token``,
   ``eos_token``, ...) as variables, ``messages``, ``tools``, ``documents`` and
   ``add_generation_prompt`` (default true), plus the request's ``chat_template_kwargs``;
2. tokenize that text with ``add_special_tokens=False`` (``ChatCompletionRequest`` default: the
   template already wrote BOS and friends).

Completions with a text prompt are tokenized with ``add_special_tokens=True`` (vLLM's default for
``/v1/completions``). Messages and tools reach the template as vLLM hands them over
(:mod:`engines.vllm.chat_messages`: text parts joined with newlines, null content as "", tool-call
arguments parsed, developer messages folded into system). What this module cannot reproduce exactly (images or
other non-text parts, ``continue_final_message``, a per-request ``chat_template``) raises
:class:`NotExact`; the gateway then routes that request by an approximate hash and counts it.

Needs the optional ``tokenizers`` and ``jinja2`` packages (``pip install 'gpuhit[tokenizer]'``). The
tokenizer must be a "fast" tokenizer (``tokenizer.json``), whose ``add_special_tokens`` behaviour is
the post-processor inside that file: the same in the ``tokenizers`` library as in transformers.
"""

from __future__ import annotations

import bisect
import json
import pathlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

from engines.hashing import common_prefix_len
from engines.vllm.chat_messages import NotExact, conversation, tool_dicts
from gpuhit.errors import BadRequestError, ConfigError, UnavailableError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):  # AddedToken as saved by transformers
        return value["content"]
    return None


class PromptTokenizer:
    """A model's tokenizer and chat template (see the module docstring). ``source`` is a directory
    holding ``tokenizer.json`` (and ``tokenizer_config.json`` for the template and special tokens) or
    a ``tokenizer.json`` path."""

    def __init__(self, source: str | pathlib.Path, memo_sessions: int = 1024):
        try:
            import tokenizers
        except ImportError:
            raise UnavailableError(
                f"--tokenizer {source} needs the `tokenizers` and `jinja2` packages (pip install 'gpuhit[tokenizer]')"
            ) from None
        path = pathlib.Path(source)
        if path.is_dir():
            tok_file, folder = path / "tokenizer.json", path
        elif path.name.endswith(".json"):
            tok_file, folder = path, path.parent
        else:
            raise ConfigError(f"tokenizer {source!r}: give a model directory holding tokenizer.json, or that file")
        if not tok_file.is_file():
            raise ConfigError(f"tokenizer {source!r}: no {tok_file} (only fast tokenizers, tokenizer.json, are supported)")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise ConfigError(f"cannot load tokenizer {tok_file}: {exc}") from None
        self.source = str(path)
        config: dict[str, Any] = {}
        cfg_file = folder / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except ValueError as exc:
                raise ConfigError(f"{cfg_file}: not JSON: {exc}") from None
        template = config.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        if isinstance(template, list):  # named templates: vLLM uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special_tokens = {k: s for k in SPECIAL_TOKEN_KEYS if (s := _token_str(config.get(k))) is not None}
        self._compiled: Any = None
        # Incremental chat tokenization (see chat_ids): the added tokens the template writes, when
        # every one of them splits the text cleanly (no whitespace stripping around it).
        added = self.tokenizer.get_added_tokens_decoder()
        clean = all(not (a.lstrip or a.rstrip or a.single_word or a.normalized) for a in added.values())
        # Metaspace (prepend_scheme "first") and Prepend normalizers treat the very start of the
        # input differently from a segment after an added token: no reuse for those tokenizers.
        spec = json.loads(self.tokenizer.to_str())
        clean = clean and not any(k in json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
                                  for k in ('"Metaspace"', '"Prepend"'))
        self._splitters = {a.content: i for i, a in added.items()
                           if clean and self.chat_template and a.content in self.chat_template}
        self._memo: OrderedDict[str, tuple[str, list[int], list[int]]] = OrderedDict()
        self.memo_sessions = memo_sessions
        self.tokens_encoded = 0  # work counter (tests): tokens produced by the tokenizer itself

    # ------------------------------------------------------------------------------ tokenizing

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def completion_ids(self, prompt: str, body: Mapping[str, Any]) -> list[int]:
        """A ``/v1/completions`` text prompt (``add_special_tokens`` default true, as vLLM)."""
        add = body.get("add_special_tokens", True)
        if not isinstance(add, bool):
            raise BadRequestError("add_special_tokens must be a boolean")
        return self.encode(prompt, add)

    def chat_ids(self, body: Mapping[str, Any], session: str | None = None) -> list[int]:
        """A ``/v1/chat/completions`` request: template rendered, then tokenized without added specials.

        Agentic conversations resend the whole history every turn, so the ids of the previous
        rendering of this conversation (keyed by ``session``, else the text's start) are reused up
        to the last template-written special token inside the common prefix: the tokenizer splits
        the text at added tokens before anything else, so what precedes such a token tokenizes the
        same whatever follows. Only the new tail is tokenized (a 100k-token history is not
        re-tokenized per turn)."""
        add = body.get("add_special_tokens", False)
        if not isinstance(add, bool):
            raise BadRequestError("add_special_tokens must be a boolean")
        text = self.render_chat(body)
        if add or not self._splitters:
            ids = self.encode(text, add)
            self.tokens_encoded += len(ids)
            return ids
        return self._encode_incremental(text, session if session is not None else text[:256])

    def _encode_incremental(self, text: str, key: str) -> list[int]:
        memo = self._memo.get(key)
        start, ids, ends = 0, [], []
        if memo is not None:
            self._memo.move_to_end(key)
            old_text, old_ids, old_ends = memo
            n = common_prefix_len(old_text, text)
            # The last template special token that lies within the common prefix and that the old
            # encoding matched as that token: a clean split point.
            for tok, tid in self._splitters.items():
                p = text.rfind(tok, 0, n)
                if p < 0 or p + len(tok) <= start:
                    continue
                k = bisect.bisect_left(old_ends, p + len(tok))
                if k < len(old_ends) and old_ends[k] == p + len(tok) and old_ids[k] == tid:
                    start, ids, ends = p + len(tok), old_ids[: k + 1], old_ends[: k + 1]
        enc = self.tokenizer.encode(text[start:], add_special_tokens=False)
        self.tokens_encoded += len(enc.ids)
        ids = ids + enc.ids
        ends = ends + [e + start for _, e in enc.offsets]
        self._memo[key] = (text, ids, ends)
        if len(self._memo) > self.memo_sessions:
            self._memo.popitem(last=False)
        return ids

    def render_chat(self, body: Mapping[str, Any]) -> str:
        if self.chat_template is None:
            raise NotExact(f"the tokenizer at {self.source} has no chat template")
        if body.get("chat_template") is not None:
            raise NotExact("a per-request chat_template")
        if body.get("continue_final_message"):
            raise NotExact("continue_final_message")
        gen = body.get("add_generation_prompt", True)
        if not isinstance(gen, bool):
            raise BadRequestError("add_generation_prompt must be a boolean")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, Mapping):
            raise BadRequestError("chat_template_kwargs must be an object")
        messages = conversation(body["messages"], self.chat_template)
        effort = body.get("reasoning_effort")
        # vLLM's merge: the request's own kwargs, overridden by the set ones of these (None and
        # "auto" leave the request's value); enable_thinking opts templates into reasoning.
        ours = {"add_generation_prompt": gen, "continue_final_message": False,
                "documents": body.get("documents"), "reasoning_effort": effort,
                "enable_thinking": effort != "none" if effort is not None and "enable_thinking" not in extra else None}
        kwargs: dict[str, Any] = {**self.special_tokens, **extra,
                                  **{k: v for k, v in ours.items() if v is not None and v != "auto"}}
        kwargs.update(messages=messages, tools=tool_dicts(body.get("tools")), documents=body.get("documents"),
                      add_generation_prompt=gen)
        try:
            return self._template().render(**kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja raises many types; vLLM answers 400 for these too
            raise BadRequestError(f"chat template failed on these messages: {exc}") from None

    def _template(self) -> Any:
        if self._compiled is None:
            self._compiled = compile_template(self.chat_template or "")
        return self._compiled


def compile_template(source: str) -> Any:
    """The chat template compiled in transformers' jinja environment (see the module docstring)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UnavailableError("chat templates need the `jinja2` package (pip install 'gpuhit[tokenizer]')") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        # Templates that print today's date (a few do) cannot be cached across days by anyone.
        return datetime.now().strftime(fmt)

    class _Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}`` tag, which only marks assistant text: rendered as is."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"the chat template does not compile: {exc}") from None


def discover(roots: Sequence[Any]) -> str | None:
    """The first engine model root (``/v1/models`` ``root``) that is a local directory with a
    ``tokenizer.json``: the engines' own tokenizer, when the gateway runs beside them."""
    for root in roots:
        if isinstance(root, str) and root and (pathlib.Path(root) / "tokenizer.json").is_file():
            return root
    return None
