"""Route-the-query over NVSHMEM (nvshmem4py): symmetric slots, put-with-signal, host-polled signal words.

One PE per GPU; a holder is a PE number. Every PE builds one :class:`NvshmemPE` (a *collective* step:
all PEs allocate the same symmetric objects in the same order), which owns, on the symmetric heap:

- ``inbox[s]`` (uint8, ``slot_bytes``) and ``inbox_sig[s]`` (one 64-bit signal word) for each
  source PE ``s``: where PE ``s``'s route requests to this PE land;
- ``reply[h]`` and ``reply_sig[h]`` for each holder PE ``h``: where holder ``h``'s answers to this
  PE land;
- two staging slots (``out_req``, ``out_rep``): nvshmem4py's host-initiated ``put`` takes its source
  from NVSHMEM-allocated memory too, so the encoded bytes are copied there first.

One slot per (source, destination) pair means several requesters can talk to one holder, and one
requester can have a request outstanding at every holder at once, without overwriting each other.

Protocol (every slot starts with :data:`_HDR` = seq, length, sender PE, status):

1. requester (PE r) -> holder (PE h): encode the request (:func:`encode_request`), copy
   header+body into ``out_req``, ``put_signal(dst=inbox[r], src=out_req, signal=inbox_sig[r],
   value=seq, SIGNAL_SET, remote_pe=h)``, ``quiet``, synchronize the stream. NVSHMEM orders the
   signal update after the data, so a holder that sees the new seq sees the whole request.
2. holder (:meth:`NvshmemHolderService.serve_once`): read its ``inbox_sig`` words; for each source
   whose word moved past the last seq served, decode, :meth:`Holder.answer`, :func:`encode_partial`,
   ``put_signal(dst=reply[h], src=out_rep, signal=reply_sig[h], value=seq, remote_pe=r)``. A request
   the holder cannot answer (chunk not resident, undecodable, reply larger than a slot) gets an
   *error reply* (status 1 and the message), so the requester fails at once with the reason instead
   of waiting out its polls.
3. requester :meth:`NvshmemQueryTransport.receive`: poll ``reply_sig[h]``; when it equals the seq it
   waits for (and the header agrees), decode. Sequence numbers increase per requester, so a stale
   reply (an earlier, abandoned request's answer landing late) never matches.

This version is host-driven: signals are polled from the host (one small device-to-host copy per
poll) and the encoded bytes cross host<->device once on each side (the wire codec is host bytes).
It also moves whole slots: nvshmem4py resolves a tensor to its whole allocation and ``put`` moves
``min(dst, src)`` bytes of them (``nvshmem/core/rma.py`` ``_call_putget``), so a message costs
``slot_bytes`` on the fabric whatever its length; size ``slot_bytes`` to the largest message. Run the
requester and holder processes with one torch intra-op thread (``OMP_NUM_THREADS=1`` or
``torch.set_num_threads(1)``): on a 16-core H100 host the pool's wake-ups cost ~6-7 ms a round trip
once a message's tensors pass torch's parallel grain (~130 KB), 8 ms against 1.4-2 ms measured
(``analysis/results/nvshmem-h100-2026-11-26.md``).
:class:`RouteStats` counts the protocol's bytes (header + payload), not the slot size. A device-side
put from the attention kernel (IBGDA) is the next step, not this one.

nvshmem4py calls: every one goes through :class:`engines.attention.nvshmem_lib.Nvshmem` (where they
are listed with the docs and source they follow), so a renamed or re-ordered function is a one-line fix.

``signal_wait`` is not used: it blocks a CUDA stream, and this host-driven version needs a host poll.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

from engines.attention.nvshmem_lib import Nvshmem, load_nvshmem_core
from engines.attention.partial import Partial
from engines.attention.transports import Holder, PolledRoute, RouteStats
from engines.attention.wire import (
    RouteRequest,
    decode_partial,
    decode_request,
    encode_partial,
    encode_request,
)
from gpuhit.errors import BadRequestError, ConfigError, GpuhitError, TransferError

__all__ = ["NvshmemHolderService", "NvshmemPE", "NvshmemQueryTransport"]

_HDR = struct.Struct("<QQII")  # seq, payload length, sender PE, status (0 ok, 1 error message)
_OK, _ERR = 0, 1


class NvshmemPE:
    """This PE's symmetric slots and signal words (see the module docstring). Collective to build and close.

    ``core`` is ``nvshmem.core`` after :func:`~engines.attention.nvshmem_lib.init_uid` (or another ``init``), or a fake PE view from
    :class:`engines.attention.fake_nvshmem.FakeNvshmemWorld`. ``slot_bytes`` must be the same on every
    PE and bound every request and reply message (header included).
    """

    def __init__(self, core: Any, *, slot_bytes: int = 1 << 20):
        if slot_bytes < _HDR.size + 64 or slot_bytes % 8:
            raise ConfigError(f"slot_bytes must be a multiple of 8 and at least {_HDR.size + 64}, got {slot_bytes}")
        self.lib = Nvshmem(core)
        self.slot_bytes = slot_bytes
        lib, n = self.lib, self.lib.n_pes
        torch = lib.torch
        # allocation order is part of the protocol: symmetric objects pair up by order on every PE
        self.inbox = [lib.alloc(slot_bytes) for _ in range(n)]
        self.inbox_sig = [lib.alloc(8, torch.int64) for _ in range(n)]
        self.reply = [lib.alloc(slot_bytes) for _ in range(n)]
        self.reply_sig = [lib.alloc(8, torch.int64) for _ in range(n)]
        self.out_req = lib.alloc(slot_bytes)
        self.out_rep = lib.alloc(slot_bytes)
        # symmetric memory starts as garbage: zero every signal word, then make sure no PE can signal
        # us before we did (the barrier)
        lib.zero(self.inbox_sig + self.reply_sig)
        lib.barrier_all()
        self._closed = False

    @property
    def my_pe(self) -> int:
        return self.lib.my_pe

    @property
    def n_pes(self) -> int:
        return self.lib.n_pes

    def close(self) -> None:
        """Free the symmetric objects (collective: every PE closes, in the same order)."""
        if self._closed:
            return
        self._closed = True
        self.lib.barrier_all()
        for t in [*self.inbox, *self.inbox_sig, *self.reply, *self.reply_sig, self.out_req, self.out_rep]:
            self.lib.free(t)


def _on_device(req: RouteRequest, device: Any) -> RouteRequest:
    """The decoded request (host tensors) moved to the PE's GPU, where the holder's chunks live."""
    if device.type == "cpu":
        return req
    pos = None if req.q_positions is None else req.q_positions.to(device)
    return RouteRequest(q=req.q.to(device), scale=req.scale, chunk_ids=req.chunk_ids, q_positions=pos)


class NvshmemHolderService:
    """Serves a :class:`Holder` on its PE: answers the requests that landed in the PE's inbox slots."""

    def __init__(self, holder: Holder, pe: NvshmemPE, *, wire_dtype: Any = None):
        self.holder = holder
        self.pe = pe
        self.wire_dtype = wire_dtype
        self._last = [0] * pe.n_pes  # last seq served per source PE
        self.served = 0
        self.errors = 0

    def serve_once(self) -> int:
        """Answer every request whose inbox signal moved; returns how many were served (0: none pending)."""
        pe = self.pe
        seqs = pe.lib.read_words(pe.inbox_sig)
        n = 0
        for src, seq in enumerate(seqs):
            if seq <= self._last[src]:
                continue
            self._last[src] = seq
            self._serve(src, seq)
            n += 1
        return n

    def _serve(self, src: int, seq: int) -> None:
        pe = self.pe
        status, payload = _OK, b""
        try:
            got_seq, length, sender, _ = _HDR.unpack(pe.lib.read_local(pe.inbox[src], _HDR.size))
            if got_seq != seq or sender != src or _HDR.size + length > pe.slot_bytes:
                raise TransferError(f"inbox slot of PE {src} holds a torn message (header seq {got_seq}, signal {seq})")
            raw = pe.lib.read_local(pe.inbox[src], _HDR.size + length)[_HDR.size :]
            req = _on_device(decode_request(raw), pe.inbox[src].device)
            payload = encode_partial(self.holder.answer(req), self.wire_dtype)
            if _HDR.size + len(payload) > pe.slot_bytes:
                raise TransferError(
                    f"partial of {len(payload)} B does not fit a reply slot ({pe.slot_bytes - _HDR.size} B usable)"
                )
        except GpuhitError as exc:
            # answer with the reason rather than leave the requester polling until it gives up
            status = _ERR
            payload = f"{type(exc).__name__}: {exc}".encode()[: pe.slot_bytes - _HDR.size]
            self.errors += 1
        pe.lib.write_local(pe.out_rep, _HDR.pack(seq, len(payload), pe.my_pe, status) + payload)
        pe.lib.put_signal(pe.reply[pe.my_pe], pe.out_rep, pe.reply_sig[pe.my_pe], seq, src)
        if status == _OK:
            self.served += 1


class NvshmemQueryTransport(PolledRoute):
    """Requester side over NVSHMEM: ``route`` = :meth:`send`, ``pump()``, :meth:`receive` (like Mooncake's).

    ``holders`` maps holder names to PE numbers (this PE included: route-to-self works). Give either
    ``pe`` (an :class:`NvshmemPE` shared with this PE's :class:`NvshmemHolderService`) or ``core``
    (``nvshmem.core`` or a fake PE view; a new :class:`NvshmemPE` is built, which is collective). With
    neither, the real library is used and construction raises :class:`UnavailableError` on a machine
    without a CUDA GPU or nvshmem4py. ``pump`` runs between polls (in one process: the holder
    services' ``serve_once``; across processes it may just yield), at most ``max_pumps`` times.
    At most one request per holder may be outstanding (one reply slot per holder).
    """

    def __init__(
        self,
        holders: Mapping[str, int] | None = None,
        *,
        pe: NvshmemPE | None = None,
        core: Any = None,
        slot_bytes: int = 1 << 20,
        wire_dtype: Any = None,
        pump: Callable[[], object] | None = None,
        max_pumps: int = 1_000_000,
    ):
        if pe is None:
            pe = NvshmemPE(core if core is not None else load_nvshmem_core(), slot_bytes=slot_bytes)
        self.pe = pe
        self.holders = dict(holders or {})
        for name, h in self.holders.items():
            if not isinstance(h, int) or not 0 <= h < pe.n_pes:
                raise ConfigError(f"holder {name!r}: PE {h!r} is not in [0, {pe.n_pes})")
        self.wire_dtype = wire_dtype
        self.pump = pump
        self.max_pumps = max_pumps
        self._seq = 0
        self._outstanding: dict[int, int] = {}  # holder PE -> seq
        self._seq_pe: dict[int, int] = {}  # seq -> holder PE
        self.stats = RouteStats()

    def send(self, holder: str, req: RouteRequest) -> int:
        """Put the request into the holder PE's inbox slot and signal it; returns the request's seq."""
        h = self.holders.get(holder)
        if h is None:
            self.stats.failures += 1
            raise TransferError(f"no holder {holder!r} on this NVSHMEM transport (known: {sorted(self.holders)})")
        if h in self._outstanding:
            raise BadRequestError(
                f"request {self._outstanding[h]} to holder {holder!r} (PE {h}) is still outstanding; receive it first"
            )
        pe = self.pe
        body = encode_request(req, self.wire_dtype)
        if _HDR.size + len(body) > pe.slot_bytes:
            self.stats.failures += 1
            raise TransferError(
                f"route request of {len(body)} B does not fit holder {holder!r}'s inbox slot "
                f"({pe.slot_bytes - _HDR.size} B usable)"
            )
        self._seq += 1
        seq = self._seq
        try:
            pe.lib.write_local(pe.out_req, _HDR.pack(seq, len(body), pe.my_pe, _OK) + body)
            pe.lib.put_signal(pe.inbox[pe.my_pe], pe.out_req, pe.inbox_sig[pe.my_pe], seq, h)
        except TransferError:
            self.stats.failures += 1
            raise
        self._outstanding[h] = seq
        self._seq_pe[seq] = h
        self.stats.requests += 1
        self.stats.bytes_sent += _HDR.size + len(body)
        return seq

    def receive(self, seq: int) -> Partial | None:
        """The partial for request ``seq`` if its reply has landed, else None (stale replies are ignored)."""
        h = self._seq_pe.get(seq)
        if h is None:
            raise BadRequestError(f"no outstanding NVSHMEM route request {seq}")
        pe = self.pe
        (got,) = pe.lib.read_words([pe.reply_sig[h]])
        if got != seq:
            return None
        got_seq, length, sender, status = _HDR.unpack(pe.lib.read_local(pe.reply[h], _HDR.size))
        if got_seq != seq or sender != h or _HDR.size + length > pe.slot_bytes:
            return None  # the signal moved before a consistent header: poll again
        raw = pe.lib.read_local(pe.reply[h], _HDR.size + length)[_HDR.size :]
        self._forget(seq)
        self.stats.bytes_received += _HDR.size + length
        if status != _OK:
            self.stats.failures += 1
            raise TransferError(f"holder PE {h} could not answer request {seq}: {raw.decode(errors='replace')}")
        return decode_partial(raw)

    def _abandon(self, seq: int) -> None:
        # give the slot up: a late reply carries this seq, which no later receive waits for
        self._forget(seq)

    def _holder_label(self, holder: str) -> str:
        return f"{holder!r} (PE {self.holders[holder]})"

    def _forget(self, seq: int) -> None:
        h = self._seq_pe.pop(seq)
        if self._outstanding.get(h) == seq:
            del self._outstanding[h]
