"""KV transfer over Mooncake's transfer engine (``from mooncake.engine import TransferEngine``).

The set-up that works on CPU machines (``tests/engines/transfer`` runs it): the ``mooncake-transfer-engine``
wheel (``-non-cuda`` without a GPU, which needs Debian's ``libibverbs1`` at import even for TCP),
``initialize(host, "P2PHANDSHAKE", protocol, device)``: no metadata server, peers are addressed as
``"host:rpc_port"`` and exchange segment descriptors on first contact. Memory a peer may touch is
allocated with ``allocate_managed_buffer`` (registered on allocation) or registered explicitly with
:meth:`MooncakeTransfer.register` (e.g. a pinned tensor's ``data_ptr()``).

The import is lazy: constructing a :class:`MooncakeTransfer` without the package or without
libibverbs raises :class:`UnavailableError` naming what is missing. A transfer the engine reports as
failed (unreachable peer, unknown segment, bad remote range) raises :class:`TransferError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.transfer.base import Buffer, Clock, KVTransfer
from gpuhit.errors import BadRequestError, TransferError, UnavailableError


def load_engine_class() -> Any:
    """``mooncake.engine.TransferEngine`` or :class:`UnavailableError` explaining why not."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        msg = str(exc)
        if "ibverbs" in msg:
            hint = "Mooncake needs libibverbs even for TCP: apt-get install -y libibverbs1"
        else:
            hint = "install 'mooncake-transfer-engine-non-cuda' (CPU) or 'mooncake-transfer-engine' (CUDA)"
        raise UnavailableError(f"Mooncake transfer engine is not importable ({msg}); {hint}") from exc
    return TransferEngine


def mooncake_available() -> tuple[bool, str]:
    """(True, "") if the engine imports, else (False, the reason) - for skip messages and CLIs."""
    try:
        load_engine_class()
    except UnavailableError as exc:
        return False, str(exc)
    return True, ""


class MooncakeTransfer(KVTransfer):
    """A Mooncake transfer-engine endpoint (one per process is the usual deployment)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        metadata: str = "P2PHANDSHAKE",
        device: str = "",
        clock: Clock | None = None,
    ):
        super().__init__(clock=clock)
        engine_cls = load_engine_class()
        self._engine = engine_cls()
        rc = self._engine.initialize(host, metadata, protocol, device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host!r}, {metadata!r}, {protocol!r}) failed with code {rc}")
        self._host = host
        self._port = int(self._engine.get_rpc_port())
        self._managed: list[Buffer] = []
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    def allocate(self, size: int) -> Buffer:
        if size <= 0:
            raise BadRequestError(f"buffer size must be positive, got {size}")
        addr = int(self._engine.allocate_managed_buffer(size))
        if addr == 0:
            raise TransferError(f"Mooncake could not allocate a managed buffer of {size} bytes")
        buf = Buffer(addr, size)
        self._managed.append(buf)
        self._buffers.append(buf)
        return buf

    def register(self, addr: int, size: int, location: str = "cpu:0") -> Buffer:
        """Register caller-owned memory (kept alive by the caller) so peers can read/write it."""
        rc = self._engine.register_memory(addr, size, location)
        if rc != 0:
            raise TransferError(f"Mooncake register_memory({addr:#x}, {size}) failed with code {rc}")
        buf = Buffer(addr, size)
        self._buffers.append(buf)
        return buf

    def write_local(self, addr: int, data: bytes) -> None:
        self._check_local(addr, len(data))
        rc = self._engine.write_bytes_to_buffer(addr, data, len(data))
        if rc != 0:
            raise TransferError(f"Mooncake write_bytes_to_buffer failed with code {rc}")

    def read_local(self, addr: int, length: int) -> bytes:
        self._check_local(addr, length)
        return bytes(self._engine.read_bytes_from_buffer(addr, length))

    def _move(self, peer: str, pairs: Sequence[tuple[int, int]], block_bytes: int, *, write: bool) -> None:
        if self._closed:
            raise TransferError("Mooncake endpoint is closed")
        locals_ = [lo for lo, _ in pairs]
        remotes = [ro for _, ro in pairs]
        if len(pairs) == 1:
            fn = self._engine.transfer_sync_write if write else self._engine.transfer_sync_read
            rc = fn(peer, locals_[0], remotes[0], block_bytes)
        else:
            fn = self._engine.batch_transfer_sync_write if write else self._engine.batch_transfer_sync_read
            rc = fn(peer, locals_, remotes, [block_bytes] * len(pairs))
        if rc != 0:
            op = "write to" if write else "read from"
            raise TransferError(
                f"Mooncake {op} {peer} failed (code {rc}, {len(pairs)} block(s) of {block_bytes} B): "
                "peer unreachable, not a Mooncake endpoint, or remote range not registered there"
            )

    def close(self) -> None:
        if self._closed:
            return
        for buf in self._managed:
            self._engine.free_managed_buffer(buf.addr, buf.size)
        self._managed.clear()
        self._buffers.clear()
        self._closed = True
