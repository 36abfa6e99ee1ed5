"""Ship query rows to the KV holder, get partials ``(o, m, l)`` back: route the query, not the cache.

Pieces:

- :class:`Holder` owns resident KV chunks and answers a :class:`RouteRequest` with one partial over
  the requested chunks (merged locally, so the wire carries one ``(o, m, l)`` per row whatever the
  number of chunks).
- A binary wire format (:mod:`engines.attention.wire`: :class:`RouteRequest`, its bytes and the
  partial's).
- Transports: :class:`InProcessTransport` (optionally through the byte codec, to test the bf16 wire),
  :class:`MooncakeQueryTransport` + :class:`MooncakeHolderService` (one-sided writes over Mooncake's
  transfer engine with a doorbell word, the put-with-signal pattern of NVSHMEM), and
  :class:`NvshmemQueryTransport` + :class:`NvshmemHolderService` (nvshmem4py put-with-signal into
  symmetric per-peer slots; in :mod:`engines.attention.nvshmem_transport`, built on this module's
  holder and :mod:`engines.attention.wire`: import them from there).

Mooncake's engine is one-sided (no RPC), so a routed request is: requester writes the request into
the holder's inbox, then bumps the inbox doorbell (a second write, ordered after the first because
``transfer_sync_write`` returns only once the bytes landed); the holder's service sees the doorbell,
computes, writes the partial into the requester's reply buffer and bumps the reply doorbell. The
service is pumped by its owner (``serve_once``), so no thread or timer is hidden in here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engines.attention.merge import merge_partial_stats
from engines.attention.partial import Partial, empty_partial, partial_attention
from engines.attention.wire import (
    RouteRequest,
    decode_partial,
    decode_request,
    encode_partial,
    encode_request,
)
from engines.transfer.base import KVTransfer
from gpuhit.errors import BadRequestError, NotFoundError, TransferError

# ------------------------------------------------------------------------------------------------
# holder
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Chunk:
    k: Any
    v: Any
    positions: Any


@dataclass(slots=True)
class HolderStats:
    requests: int = 0
    rows: int = 0


class Holder:
    """An instance's resident KV chunks and the partial-attention service over them."""

    def __init__(self, name: str, *, upcast: bool = True):
        self.name = name
        self.upcast = upcast
        self._chunks: dict[str, _Chunk] = {}
        self.stats = HolderStats()

    def add_chunk(self, chunk_id: str, k: Any, v: Any, positions: Any = None) -> None:
        """Make ``(k [N,Hkv,d_qk], v [N,Hkv,d_v])`` resident; ``positions`` [N] enable causal rows."""
        if chunk_id in self._chunks:
            raise BadRequestError(f"holder {self.name}: chunk {chunk_id!r} is already resident")
        if k.shape[0] != v.shape[0] or (positions is not None and len(positions) != k.shape[0]):
            raise BadRequestError(f"holder {self.name}: chunk {chunk_id!r} k/v/positions lengths differ")
        self._chunks[chunk_id] = _Chunk(k, v, positions)

    def drop_chunk(self, chunk_id: str) -> None:
        if self._chunks.pop(chunk_id, None) is None:
            raise NotFoundError(f"holder {self.name}: no chunk {chunk_id!r}")

    @property
    def chunk_ids(self) -> tuple[str, ...]:
        return tuple(self._chunks)

    def answer(self, req: RouteRequest) -> Partial:
        """One partial over the requested chunks (the zero-weight identity if they hold no tokens)."""
        ids = self.chunk_ids if req.chunk_ids is None else req.chunk_ids
        missing = [c for c in ids if c not in self._chunks]
        if missing:
            raise NotFoundError(f"holder {self.name}: chunks not resident: {missing}")
        mq, hq = int(req.q.shape[0]), int(req.q.shape[1])
        parts = []
        for cid in ids:
            ch = self._chunks[cid]
            if req.q_positions is not None and ch.positions is None:
                raise BadRequestError(f"holder {self.name}: causal rows need positions for chunk {cid!r}")
            # the wire dtype need not be the cache dtype: attend in the holder's cache dtype
            parts.append(
                partial_attention(
                    req.q.to(ch.k.dtype), ch.k, ch.v, scale=req.scale, upcast=self.upcast,
                    q_positions=req.q_positions, k_positions=ch.positions if req.q_positions is not None else None,
                )
            )
        self.stats.requests += 1
        self.stats.rows += mq
        if not parts:
            d_v = 0 if not self._chunks else int(next(iter(self._chunks.values())).v.shape[2])
            return empty_partial(mq, hq, d_v, device=req.q.device)
        return merge_partial_stats(parts)


def route_and_merge(transport: Any, requests: Mapping[str, RouteRequest], local: Sequence[Partial] = ()) -> Any:
    """Route each holder's request, merge the partials with any local ones: the attention output."""
    parts = list(local) + [transport.route(h, r) for h, r in requests.items()]
    return merge_partial_stats(parts).o


# ------------------------------------------------------------------------------------------------
# in-process transport
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class RouteStats:
    """Running totals of a query transport."""

    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    failures: int = 0


class InProcessTransport:
    """Holders in this process. With ``wire_dtype`` set, every request and reply goes through the byte
    codec (so a test sees exactly what a bf16 wire does to the result); without it, tensors pass as is."""

    def __init__(self, holders: Mapping[str, Holder], *, wire_dtype: Any = None):
        self._holders = dict(holders)
        self.wire_dtype = wire_dtype
        self.stats = RouteStats()

    def route(self, holder: str, req: RouteRequest) -> Partial:
        h = self._holders.get(holder)
        if h is None:
            self.stats.failures += 1
            raise TransferError(f"no holder {holder!r} on this in-process transport (known: {sorted(self._holders)})")
        self.stats.requests += 1
        if self.wire_dtype is None:
            return h.answer(req)
        wire = encode_request(req, self.wire_dtype)
        self.stats.bytes_sent += len(wire)
        reply = encode_partial(h.answer(decode_request(wire)), self.wire_dtype)
        self.stats.bytes_received += len(reply)
        return decode_partial(reply)


# ------------------------------------------------------------------------------------------------
# Mooncake transport (one-sided writes + doorbells)
# ------------------------------------------------------------------------------------------------

_BELL = struct.Struct("<QQ")  # sequence number, payload length
_ENV = struct.Struct("<QQH")  # reply address, reply capacity, reply-peer length


@dataclass(frozen=True, slots=True)
class HolderEndpoint:
    """Where a holder service listens: its transfer-engine address and inbox buffer address."""

    peer: str
    inbox_addr: int
    inbox_size: int


class MooncakeHolderService:
    """Serves a :class:`Holder` through a registered inbox on a :class:`KVTransfer` endpoint."""

    def __init__(self, holder: Holder, transfer: KVTransfer, *, inbox_bytes: int = 1 << 20, wire_dtype: Any = None):
        self.holder = holder
        self.transfer = transfer
        self.wire_dtype = wire_dtype
        self._inbox = transfer.allocate(inbox_bytes)
        self._out = transfer.allocate(inbox_bytes)
        self._last_seq = 0
        self.served = 0

    @property
    def endpoint(self) -> HolderEndpoint:
        return HolderEndpoint(self.transfer.address, self._inbox.addr, self._inbox.size)

    def serve_once(self) -> bool:
        """Answer the pending request if the doorbell moved; True if one was served."""
        seq, length = _BELL.unpack(self.transfer.read_local(self._inbox.addr, _BELL.size))
        if seq == self._last_seq:
            return False
        self._last_seq = seq
        raw = self.transfer.read_local(self._inbox.addr + _BELL.size, length)
        reply_addr, reply_cap, peer_len = _ENV.unpack_from(raw, 0)
        peer = raw[_ENV.size : _ENV.size + peer_len].decode()
        req = decode_request(memoryview(raw)[_ENV.size + peer_len :])
        payload = encode_partial(self.holder.answer(req), self.wire_dtype)
        if _BELL.size + len(payload) > min(reply_cap, self._out.size):
            raise TransferError(f"partial of {len(payload)} B does not fit the requester's reply buffer ({reply_cap} B)")
        self.transfer.write_local(self._out.addr + _BELL.size, payload)
        self.transfer.write(peer, self._out.addr + _BELL.size, reply_addr + _BELL.size, len(payload))
        self.transfer.write_local(self._out.addr, _BELL.pack(seq, len(payload)))
        self.transfer.write(peer, self._out.addr, reply_addr, _BELL.size)
        self.served += 1
        return True


class PolledRoute:
    """``route`` for requester transports that post a request and poll for its reply: :meth:`send`,
    then :meth:`receive` until the reply lands, calling ``pump()`` (the holder side's turn) between
    polls, at most ``max_pumps`` times. Subclasses set ``pump``, ``max_pumps`` and ``stats`` and
    may override :meth:`_abandon` (give up a request's slot) and :meth:`_holder_label`."""

    pump: Callable[[], object] | None
    max_pumps: int
    stats: RouteStats

    def send(self, holder: str, req: RouteRequest) -> int:
        raise NotImplementedError

    def receive(self, seq: int) -> Partial | None:
        raise NotImplementedError

    def route(self, holder: str, req: RouteRequest) -> Partial:
        seq = self.send(holder, req)
        for _ in range(self.max_pumps):
            got = self.receive(seq)
            if got is not None:
                return got
            if self.pump is not None:
                self.pump()
        self._abandon(seq)
        self.stats.failures += 1
        raise TransferError(f"no reply from holder {self._holder_label(holder)} for request {seq} "
                            f"after {self.max_pumps} polls")

    def _abandon(self, seq: int) -> None:
        """Forget request ``seq`` after its polls ran out (nothing to do by default)."""

    def _holder_label(self, holder: str) -> str:
        return repr(holder)


class MooncakeQueryTransport(PolledRoute):
    """Requester side. ``route`` = :meth:`send`, ``pump()`` (the holder side runs), :meth:`receive`.

    ``holders`` maps holder names to their :class:`HolderEndpoint`. ``pump`` is called between send
    and receive until the reply doorbell moves (at most ``max_pumps`` times): in one process it is the
    holder service's ``serve_once``; across processes the holder runs its own loop and ``pump`` may
    yield to it.
    """

    def __init__(
        self,
        transfer: KVTransfer,
        holders: Mapping[str, HolderEndpoint],
        *,
        reply_bytes: int = 1 << 20,
        wire_dtype: Any = None,
        pump: Callable[[], object] | None = None,
        max_pumps: int = 1_000_000,
    ):
        self.transfer = transfer
        self.holders = dict(holders)
        self.wire_dtype = wire_dtype
        self.pump = pump
        self.max_pumps = max_pumps
        self._reply = transfer.allocate(reply_bytes)
        self._out = transfer.allocate(reply_bytes)
        self._seq = 0
        self.stats = RouteStats()

    def send(self, holder: str, req: RouteRequest) -> int:
        ep = self.holders.get(holder)
        if ep is None:
            self.stats.failures += 1
            raise TransferError(f"no holder endpoint {holder!r} (known: {sorted(self.holders)})")
        me = self.transfer.address.encode()
        body = _ENV.pack(self._reply.addr, self._reply.size, len(me)) + me + encode_request(req, self.wire_dtype)
        if _BELL.size + len(body) > min(ep.inbox_size, self._out.size):
            raise TransferError(f"route request of {len(body)} B does not fit holder {holder!r}'s inbox ({ep.inbox_size} B)")
        self._seq += 1
        try:
            self.transfer.write_local(self._out.addr + _BELL.size, body)
            self.transfer.write(ep.peer, self._out.addr + _BELL.size, ep.inbox_addr + _BELL.size, len(body))
            self.transfer.write_local(self._out.addr, _BELL.pack(self._seq, len(body)))
            self.transfer.write(ep.peer, self._out.addr, ep.inbox_addr, _BELL.size)
        except TransferError:
            self.stats.failures += 1
            raise
        self.stats.requests += 1
        self.stats.bytes_sent += _BELL.size + len(body)
        return self._seq

    def receive(self, seq: int) -> Partial | None:
        """The partial for request ``seq`` if its reply has landed, else None."""
        got, length = _BELL.unpack(self.transfer.read_local(self._reply.addr, _BELL.size))
        if got != seq:
            return None
        raw = self.transfer.read_local(self._reply.addr + _BELL.size, length)
        self.stats.bytes_received += _BELL.size + length
        return decode_partial(raw)
