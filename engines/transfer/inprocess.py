"""In-process KV transfer: endpoints on one :class:`InProcessFabric` copy bytes between bytearrays.

Same interface and the same failure semantics as Mooncake (unknown peer, range outside the peer's
registered memory -> :class:`TransferError`), so the emulator and tests exercise the real call
sequence without sockets. Addresses are synthetic but unique per fabric, like virtual addresses.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.transfer.base import Buffer, Clock, KVTransfer
from gpuhit.errors import BadRequestError, ConfigError, TransferError

_ALIGN = 1 << 12


class InProcessFabric:
    """The "network": endpoint name -> endpoint, plus an address allocator shared by all endpoints."""

    def __init__(self) -> None:
        self._endpoints: dict[str, InProcessTransfer] = {}
        self._next_addr = 1 << 20

    def endpoint(self, name: str, *, clock: Clock | None = None) -> InProcessTransfer:
        """Create and attach a new endpoint called ``name`` (a duplicate name raises)."""
        if name in self._endpoints:
            raise ConfigError(f"in-process transfer endpoint {name!r} already exists")
        ep = InProcessTransfer(self, name, clock=clock)
        self._endpoints[name] = ep
        return ep

    def _lookup(self, name: str) -> InProcessTransfer:
        try:
            return self._endpoints[name]
        except KeyError:
            raise TransferError(f"no in-process transfer endpoint {name!r} (known: {sorted(self._endpoints)})") from None

    def _detach(self, name: str) -> None:
        self._endpoints.pop(name, None)

    def _reserve(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += (size + _ALIGN - 1) // _ALIGN * _ALIGN + _ALIGN
        return addr


class InProcessTransfer(KVTransfer):
    """One endpoint; see the module docstring."""

    def __init__(self, fabric: InProcessFabric, name: str, *, clock: Clock | None = None):
        super().__init__(clock=clock)
        self._fabric = fabric
        self._name = name
        self._mem: dict[int, bytearray] = {}  # buffer base address -> bytes

    @property
    def address(self) -> str:
        return self._name

    def allocate(self, size: int) -> Buffer:
        if size <= 0:
            raise BadRequestError(f"buffer size must be positive, got {size}")
        addr = self._fabric._reserve(size)
        self._mem[addr] = bytearray(size)
        buf = Buffer(addr, size)
        self._buffers.append(buf)
        return buf

    def _view(self, addr: int, length: int, *, who: str) -> memoryview:
        for buf in self._buffers:
            if buf.contains(addr, length):
                off = addr - buf.addr
                return memoryview(self._mem[buf.addr])[off : off + length]
        raise TransferError(f"range [{addr:#x}, +{length}) is outside {who}'s registered memory")

    def write_local(self, addr: int, data: bytes) -> None:
        self._view(addr, len(data), who=self._name)[:] = data

    def read_local(self, addr: int, length: int) -> bytes:
        return bytes(self._view(addr, length, who=self._name))

    def close(self) -> None:
        self._fabric._detach(self._name)
        self._mem.clear()
        self._buffers.clear()

    def _move(self, peer: str, pairs: Sequence[tuple[int, int]], block_bytes: int, *, write: bool) -> None:
        other = self._fabric._lookup(peer)
        # validate every remote range before copying anything: a batch fails whole, like a bad request
        views = [(self._view(lo, block_bytes, who=self._name), other._view(ro, block_bytes, who=peer)) for lo, ro in pairs]
        for local, remote in views:
            if write:
                remote[:] = local
            else:
                local[:] = remote
