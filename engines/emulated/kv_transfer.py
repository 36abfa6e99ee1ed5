"""In-process stand-in for a KV connector's transfer side (Mooncake / NIXL) between emulated engines.

A producer engine finishing a ``do_remote_decode`` request keeps that request's blocks pinned
(vLLM's ``delay_free_blocks``) and registers them here under the router's ``transfer_id``. A
consumer engine with ``do_remote_prefill`` claims the entry, pays the transfer over the NIC in
loop time, then calls ``release()`` so the producer frees the blocks. Unclaimed entries are
released after ``timeout_s`` of loop time (vLLM's abort timeout for un-pulled KV), so a lost
consumer never leaks the producer's cache. One registry is shared by the engines of a simulation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class TransferEntry:
    transfer_id: str
    engine_name: str
    block_hashes: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_tokens: int
    _release: Callable[[], None]
    _timer: asyncio.TimerHandle | None = None
    released: bool = False

    def release(self) -> None:
        """Unpin the producer's blocks (idempotent)."""
        if self.released:
            return
        self.released = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._release()


class TransferRegistry:
    """``transfer_id`` -> pinned producer blocks, with a loop-time expiry."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self._entries: dict[str, TransferEntry] = {}
        self.registered = 0
        self.claimed = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def register(
        self,
        transfer_id: str,
        engine_name: str,
        block_hashes: tuple[int, ...],
        block_ids: tuple[int, ...],
        num_tokens: int,
        release: Callable[[], None],
    ) -> TransferEntry:
        old = self._entries.pop(transfer_id, None)
        if old is not None:  # a retried producer request: the newer KV wins
            old.release()
        entry = TransferEntry(transfer_id, engine_name, block_hashes, block_ids, num_tokens, release)
        loop = asyncio.get_running_loop()
        entry._timer = loop.call_later(self.timeout_s, self._expire, transfer_id, entry)
        self._entries[transfer_id] = entry
        self.registered += 1
        return entry

    def _expire(self, transfer_id: str, entry: TransferEntry) -> None:
        if self._entries.get(transfer_id) is entry:
            del self._entries[transfer_id]
            entry._timer = None
            self.expired += 1
            entry.release()

    def peek(self, transfer_id: str) -> TransferEntry | None:
        return self._entries.get(transfer_id)

    def claim(self, transfer_id: str) -> TransferEntry | None:
        """Take the entry (None if unknown or expired). The caller must ``release()`` it."""
        entry = self._entries.pop(transfer_id, None)
        if entry is not None:
            self.claimed += 1
        return entry
