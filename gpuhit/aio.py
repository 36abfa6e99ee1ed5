"""Small asyncio helpers shared by the background tasks of engines, gateway and replayer."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it has really stopped, swallowing its cancellation.

    Background loops (metrics scrapers, health checks, KV-event subscribers) are stopped this way
    so that ``close()`` returns only once nothing of theirs can run any more.
    """
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def until_signalled() -> None:
    """Wait for SIGINT/SIGTERM (Ctrl-C, kill): the long-running commands (``gpuhit serve``,
    ``gpuhit emulate``) then shut down cleanly, whatever the loop implementation."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
