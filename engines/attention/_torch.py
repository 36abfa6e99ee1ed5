"""Lazy torch import: the attention primitive is optional, the rest of gpuhit must not need torch."""

from __future__ import annotations

from typing import Any

from gpuhit.errors import UnavailableError


def require_torch() -> Any:
    """Return the ``torch`` module or raise :class:`UnavailableError` saying how to get it."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is in the test venv
        raise UnavailableError(
            f"the attention primitive needs torch ({exc}); install the 'torch' extra: pip install 'gpuhit[torch]'"
        ) from exc
    return torch
