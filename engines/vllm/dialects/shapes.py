"""Checks of request JSON shared by the dialect converters: 400s shaped as vLLM's (``param`` set)."""

from __future__ import annotations

from typing import Any

from engines.vllm.protocol import bad_request
from gpuhit.errors import BadRequestError


def bad(message: str, param: str) -> BadRequestError:
    return bad_request(message, param)


def check_list(value: Any, param: str, empty: bool = False) -> list[Any]:
    """``value`` if it is a list (non-empty unless ``empty``), else a 400 naming ``param``."""
    if not isinstance(value, list) or (not value and not empty):
        raise bad(f"{param} must be a {'' if empty else 'non-empty '}list", param)
    return value


def check_str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{param}: expected a string, got {type(value).__name__}", param)
    return value
