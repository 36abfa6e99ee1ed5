"""The KV transfer interface: registered local buffers, one-sided reads/writes of byte ranges to a peer.

Why one-sided: both Mooncake's transfer engine and NVSHMEM move bytes between *registered* memory
regions addressed by (peer, address); the receiving side runs no code. A KV block of an instance's
cache is such a range, so "move these blocks" is a batch of (local address, remote address, length)
triples. Higher layers (migration, route-the-query transports) add their own signalling.

Time: transfers here are synchronous calls; their duration is measured with an injected ``clock``
(default: the running asyncio loop's ``time()``, else no timing) so the same code is valid under the
virtual-time loop and nothing in engines/ reads the wall clock directly.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuhit.errors import BadRequestError

Clock = Callable[[], float]


def loop_clock() -> float:
    """The running loop's clock, or 0.0 outside a loop (then durations read 0, never wrong times)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return 0.0


@dataclass(frozen=True, slots=True)
class Buffer:
    """A registered local memory region: ``addr`` is what a peer passes as the remote address."""

    addr: int
    size: int

    def contains(self, addr: int, length: int) -> bool:
        return self.addr <= addr and addr + length <= self.addr + self.size


@dataclass(slots=True)
class TransferStats:
    """Running totals (never windowed): what moved, how long it took, what failed."""

    bytes_written: int = 0
    bytes_read: int = 0
    writes: int = 0
    reads: int = 0
    failures: int = 0
    time_s: float = 0.0

    @property
    def bytes_moved(self) -> int:
        return self.bytes_written + self.bytes_read

    def as_dict(self) -> dict[str, float]:
        return {
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "writes": self.writes,
            "reads": self.reads,
            "failures": self.failures,
            "time_s": self.time_s,
        }


class KVTransfer(ABC):
    """One endpoint of a KV transfer fabric.

    Subclasses implement :meth:`_move` (one batch of ranges to/from one peer) and buffer allocation;
    this base validates local ranges (a bad local address would otherwise be a segfault in native
    code) and keeps :attr:`stats`.
    """

    def __init__(self, *, clock: Clock | None = None):
        self.stats = TransferStats()
        self._clock: Clock = clock or loop_clock
        self._buffers: list[Buffer] = []

    # -- endpoint ---------------------------------------------------------------------------------
    @property
    @abstractmethod
    def address(self) -> str:
        """What a peer passes as ``peer`` to reach this endpoint (e.g. ``"127.0.0.1:15787"``)."""

    @abstractmethod
    def allocate(self, size: int) -> Buffer:
        """Allocate and register ``size`` bytes a peer may read or write."""

    @abstractmethod
    def write_local(self, addr: int, data: bytes) -> None:
        """Copy ``data`` into this endpoint's registered memory at ``addr`` (no transfer)."""

    @abstractmethod
    def read_local(self, addr: int, length: int) -> bytes:
        """Bytes of this endpoint's registered memory at ``addr`` (no transfer)."""

    def close(self) -> None:
        """Release native resources; the endpoint is unusable afterwards."""

    # -- transfers --------------------------------------------------------------------------------
    def write(self, peer: str, local_addr: int, remote_addr: int, length: int) -> None:
        """Push ``length`` bytes from local ``local_addr`` to the peer's ``remote_addr``."""
        self.write_blocks(peer, [(local_addr, remote_addr)], length)

    def read(self, peer: str, local_addr: int, remote_addr: int, length: int) -> None:
        """Pull ``length`` bytes from the peer's ``remote_addr`` into local ``local_addr``."""
        self.read_blocks(peer, [(local_addr, remote_addr)], length)

    def write_blocks(self, peer: str, pairs: Sequence[tuple[int, int]], block_bytes: int) -> None:
        """Push equal-size blocks: ``pairs`` of (local address, remote address)."""
        self._batch(peer, pairs, block_bytes, write=True)

    def read_blocks(self, peer: str, pairs: Sequence[tuple[int, int]], block_bytes: int) -> None:
        """Pull equal-size blocks: ``pairs`` of (local address, remote address)."""
        self._batch(peer, pairs, block_bytes, write=False)

    def _batch(self, peer: str, pairs: Sequence[tuple[int, int]], block_bytes: int, *, write: bool) -> None:
        if block_bytes <= 0:
            raise BadRequestError(f"block size must be positive, got {block_bytes}")
        if not pairs:
            return
        for local, _ in pairs:
            self._check_local(local, block_bytes)
        t0 = self._clock()
        try:
            self._move(peer, pairs, block_bytes, write=write)
        except Exception:
            self.stats.failures += 1
            self.stats.time_s += max(self._clock() - t0, 0.0)
            raise
        self.stats.time_s += max(self._clock() - t0, 0.0)
        n = len(pairs) * block_bytes
        if write:
            self.stats.bytes_written += n
            self.stats.writes += len(pairs)
        else:
            self.stats.bytes_read += n
            self.stats.reads += len(pairs)

    def _check_local(self, addr: int, length: int) -> None:
        if not any(b.contains(addr, length) for b in self._buffers):
            raise BadRequestError(
                f"local range [{addr:#x}, +{length}) is not inside a buffer registered with this endpoint"
            )

    @abstractmethod
    def _move(self, peer: str, pairs: Sequence[tuple[int, int]], block_bytes: int, *, write: bool) -> None:
        """Do the transfer; raise :class:`gpuhit.errors.TransferError` on failure."""
