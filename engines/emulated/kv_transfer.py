"""In-process stand-in for a KV connector's transfer side (Mooncake / NIXL) between emulated engines.

A producer engine finishing a ``do_remote_decode`` request keeps that request's blocks pinned
(vLLM's ``delay_free_blocks``) and registers them here under the router's ``transfer_id``. A
consumer engine with ``do_remote_prefill`` claims the entry, pays the transfer over the NIC in
loop time, then calls ``release()`` so the producer frees the blocks. Unclaimed entries are
released after ``timeout_s`` of loop time (vLLM's abort timeout for un-pulled KV), so a lost
consumer never leaks the producer's cache. One registry is shared by the engines of a simulation.

Across processes (``gpuhit emulate``: one engine per server) the consumer pulls over HTTP instead
(:mod:`engines.emulated.remote_transfer`): the producer's bootstrap service claims the entry with a
*lease* (``claim(tid, lease_s=...)``), so a consumer that pulled the metadata but died before
telling the producer it is done still cannot pin the producer's blocks forever; the consumer's
"done" arrives as ``release_leased(tid)``. The consumer keeps a proxy entry in its own registry
whose ``release`` sends that "done" back to the producer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


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
        self._leased: dict[str, TransferEntry] = {}
        self.registered = 0
        self.claimed = 0
        self.expired = 0
        self.lease_expired = 0  # claimed remotely, never released by the consumer in time

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
        timeout_s: float | None = None,
    ) -> TransferEntry:
        """Pin ``block_hashes`` under ``transfer_id`` until claimed or ``timeout_s`` (default: the
        registry's) of loop time has passed."""
        old = self._entries.pop(transfer_id, None)
        if old is not None:  # a retried producer request: the newer KV wins
            old.release()
        entry = TransferEntry(transfer_id, engine_name, block_hashes, block_ids, num_tokens, release)
        loop = asyncio.get_running_loop()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        entry._timer = loop.call_later(timeout, self._expire, transfer_id, entry)
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

    def claim(self, transfer_id: str, lease_s: float | None = None) -> TransferEntry | None:
        """Take the entry (None if unknown or expired). The caller must ``release()`` it.

        With ``lease_s`` (a remote consumer, which may vanish) the entry stays findable through
        :meth:`release_leased` and is released by itself after ``lease_s`` of loop time.
        """
        entry = self._entries.pop(transfer_id, None)
        if entry is None:
            return None
        self.claimed += 1
        if lease_s is not None:
            if entry._timer is not None:
                entry._timer.cancel()
            old = self._leased.pop(transfer_id, None)
            if old is not None:  # a stale lease under a reused id: its consumer lost the race
                old.release()
            self._leased[transfer_id] = entry
            entry._timer = asyncio.get_running_loop().call_later(lease_s, self._lease_over, transfer_id, entry)
        return entry

    def _lease_over(self, transfer_id: str, entry: TransferEntry) -> None:
        if self._leased.get(transfer_id) is entry:
            del self._leased[transfer_id]
            entry._timer = None
            self.lease_expired += 1
            entry.release()

    def release_leased(self, transfer_id: str) -> bool:
        """The remote consumer is done with a leased entry: unpin it. False if unknown (never
        claimed with a lease, already released, or the lease ran out)."""
        entry = self._leased.pop(transfer_id, None)
        if entry is None:
            return False
        entry.release()
        return True

    def num_leased(self) -> int:
        return len(self._leased)


def is_http_addr(addr: Any) -> bool:
    """True for a bootstrap address reached over HTTP (the in-process path uses engine names)."""
    return isinstance(addr, str) and addr.startswith(("http://", "https://"))


class RemotePuller(Protocol):
    """The consumer side of a cross-process transfer, as the engine uses it: pull an entry from the
    producer named in the request's ``kv_transfer_params`` into the engine's registry, and close.
    :class:`engines.emulated.remote_transfer.RemoteTransferClient` is the HTTP one; the engine
    names only this protocol, so the core does not depend on the network service built on it."""

    async def pull(self, params: Mapping[str, Any], block_size: int, registry: TransferRegistry,
                   block_bytes: int | None = None) -> TransferEntry | None: ...

    async def close(self) -> None: ...
