"""KV block transfer between instances: one :class:`~engines.transfer.base.KVTransfer` interface,
implemented over Mooncake's transfer engine (:mod:`.mooncake`, TCP or RDMA, P2P handshake) and
in-process (:mod:`.inprocess`, for the emulator and tests). Bytes, transfer time and failures are
kept as running totals in :class:`~engines.transfer.base.TransferStats`."""

from engines.transfer.base import Buffer, KVTransfer, TransferStats

__all__ = ["Buffer", "KVTransfer", "TransferStats"]
