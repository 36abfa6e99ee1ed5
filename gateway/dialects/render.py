"""Messages and Responses requests to the token ids vLLM runs, through the engines' chat template.

Each dialect is converted to the chat request vLLM renders for it (:mod:`engines.vllm.dialects.anthropic`,
:mod:`engines.vllm.dialects.responses`), then tokenized by the chat path
(:meth:`gateway.tokenizer.PromptTokenizer.chat_ids`), which reuses the previous turn's ids of the
session. Two choices vLLM's Messages server makes once, by probing the served template, are made
here the same way on the same template:

* whether inline system messages must be merged into the leading one: the template fails on a
  ``[system, user, system, user]`` conversation (rendered in a bare sandboxed jinja environment,
  as vLLM's probe does);
* what ``thinking: {"type": "disabled"}`` sends as ``reasoning_effort``: ``"none"``, unless the
  template rejects it or renders it as it renders some real effort (then ``"low"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engines.vllm.dialects import anthropic, responses
from gateway.tokenizer import PromptTokenizer

_EFFORTS = ("low", "medium", "high", "xhigh", "max")


class DialectRenderer:
    """Token ids of agentic-dialect requests for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: PromptTokenizer):
        self.tokenizer = tokenizer
        self._merge: bool | None = None
        self._disabled_effort: str | None = None

    def messages_chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat request vLLM renders for a ``/v1/messages`` body."""
        thinking = body.get("thinking")
        disabled = isinstance(thinking, Mapping) and thinking.get("type") == "disabled"
        return anthropic.to_chat(body, self.merge_inline_system(), self.disabled_effort() if disabled else "none")

    def messages_ids(self, body: Mapping[str, Any], session: str | None = None) -> list[int]:
        return self.tokenizer.chat_ids(self.messages_chat(body), session)

    def responses_chat(self, body: Mapping[str, Any],
                       previous: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The chat request vLLM renders for a ``/v1/responses`` body (``previous``: what the
        named previous response leaves, from :class:`gateway.dialects.history.ResponseHistory`)."""
        return responses.to_chat(body, previous)

    def responses_ids(self, body: Mapping[str, Any], session: str | None = None,
                      previous: Sequence[Mapping[str, Any]] | None = None) -> tuple[list[int], dict[str, Any]]:
        """(ids, the chat request rendered): the history records the latter's messages."""
        chat = self.responses_chat(body, previous)
        return self.tokenizer.chat_ids(chat, session), chat

    def merge_inline_system(self) -> bool:
        if self._merge is None:
            self._merge = _rejects_inline_system(self.tokenizer.chat_template)
        return self._merge

    def disabled_effort(self) -> str:
        if self._disabled_effort is None:
            none = self._probe("none")
            self._disabled_effort = "low" if none is None or any(self._probe(e) == none for e in _EFFORTS) else "none"
        return self._disabled_effort

    def _probe(self, effort: str) -> str | None:
        try:
            return self.tokenizer.render_chat({"messages": [{"role": "user", "content": "Hi"}],
                                               "reasoning_effort": effort})
        except Exception:  # noqa: BLE001 - vLLM's probe treats any failure as "rejects"
            return None


def _rejects_inline_system(template: str | None) -> bool:
    """vLLM's ``_detect_merge_inline_system``: no template, or one that raises a jinja error on a
    system message after the first."""
    if not template:
        return True
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.from_string(template).render(
            messages=[{"role": r, "content": "t"} for r in ("system", "user", "system", "user")],
            add_generation_prompt=False)
        return False
    except jinja2.TemplateError:
        return True
