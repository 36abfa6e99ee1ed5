"""Passing an emulated engine's output tokens to a stream as the engine produces them.

Every streamed route of the emulated server (completions and chat, Anthropic Messages, OpenAI
Responses) writes one event per token at the token's own decode-step time, as vLLM does. They
differ in what they write, not in how they wait: :func:`relay_tokens` is that one waiting loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class Progress:
    """Output-token count reported by the engine, awaited by the streaming writer. ``per_step``
    asks the engine to report every decode step at its own time, even inside a decode jump."""

    __slots__ = ("changed", "count")
    per_step = True

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def __call__(self, total: int) -> None:
        if total > self.count:  # per-step reports scheduled ahead can land after a catch-up
            self.count = total
            self.changed.set()


async def relay_tokens(task: asyncio.Future[Any], progress: Progress,
                       on_token: Callable[[int], Awaitable[None]], limit: int | None = None) -> int:
    """Await ``on_token(k)`` for each output token ``task`` (the engine's ``generate`` reporting to
    ``progress``) produces, while it runs, at most ``limit`` of them (a route holding the last
    token back for its finish event passes ``max_tokens - 1``). Returns how many were passed on;
    the caller passes on the rest from the finished result, which this does not read."""
    sent = 0
    while not task.done():
        waiter = asyncio.ensure_future(progress.changed.wait())
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        progress.changed.clear()
        ready = progress.count if limit is None else min(progress.count, limit)
        while sent < ready and not task.done():
            await on_token(sent)
            sent += 1
    return sent


__all__ = ["Progress", "relay_tokens"]
