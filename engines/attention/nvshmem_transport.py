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

nvshmem4py calls (every one goes through :class:`_Nvshmem`; names and argument orders as in the
NVSHMEM 3.x docs, ``docs.nvidia.com/nvshmem/api/latest/api/language_bindings/python/`` and the
source ``NVIDIA/nvshmem`` ``nvshmem4py/nvshmem/core/``):

- ``my_pe()``, ``n_pes()``: overview page (Quick Start) / ``core/direct.py``;
- ``tensor(shape, dtype)``, ``tensor_get_buffer(t) -> (Buffer, size, dtype)``, ``free_tensor(t)``:
  ``interoperability.html`` / ``core/interop/torch.py``;
- ``put_signal(dst, src, signal_var, signal_val, signal_op, remote_pe, stream=)``, ``quiet(stream=)``,
  ``SignalOp.SIGNAL_SET``: ``rma.html`` / ``core/rma.py`` (``signal_var`` must be a Buffer >= 8 B,
  hence ``tensor_get_buffer``; ``stream`` must not be None and is used as ``stream.__cuda_stream__()``);
- ``barrier_all(stream=)``: ``collective.html`` / ``core/collective.py``;
- ``get_unique_id()``, ``init(device=, uid=, rank=, nranks=, initializer_method="uid")``,
  ``finalize()``: ``initialization.html`` / ``core/init_fini.py`` (see :func:`init_uid`).

Every name and argument order above was checked against the source of the nvshmem4py-cu13 0.4.1 wheel
(``core/direct.py``, ``core/interop/torch.py``, ``core/rma.py``, ``core/collective.py``,
``core/init_fini.py``); ``tests/perf/gpu_nvshmem_check.py`` runs this module against it on one GPU.

``signal_wait`` is not used: it blocks a CUDA stream, and this host-driven version needs a host poll.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

from engines.attention._torch import require_torch
from engines.attention.partial import Partial
from engines.attention.transports import Holder, PolledRoute, RouteStats
from engines.attention.wire import (
    RouteRequest,
    decode_partial,
    decode_request,
    encode_partial,
    encode_request,
)
from gpuhit.errors import BadRequestError, ConfigError, GpuhitError, TransferError, UnavailableError

__all__ = ["NvshmemHolderService", "NvshmemPE", "NvshmemQueryTransport", "init_uid", "load_nvshmem_core"]

_HDR = struct.Struct("<QQII")  # seq, payload length, sender PE, status (0 ok, 1 error message)
_OK, _ERR = 0, 1


def load_nvshmem_core() -> Any:
    """``nvshmem.core`` on a CUDA machine, else :class:`UnavailableError` saying what is missing."""
    torch = require_torch()
    if not torch.cuda.is_available():
        raise UnavailableError("the NVSHMEM transport needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        from nvshmem import core  # nvshmem4py (nvshmem.core)
    except ImportError as exc:
        raise UnavailableError(
            f"the NVSHMEM transport needs nvshmem4py ({exc}); pip install nvshmem4py-cu12 or nvshmem4py-cu13 "
            "(the one matching torch.version.cuda)"
        ) from exc
    return core


def init_uid(core: Any, *, rank: int, nranks: int, uid: Any = None, device_index: int | None = None) -> None:
    """UID-based ``nvshmem.core.init`` for this process as PE ``rank`` of ``nranks``.

    Rank 0 may pass ``uid=None`` only when ``nranks == 1``; otherwise the launcher creates the id on
    rank 0 (``core.get_unique_id()``) and broadcasts its bytes to every rank (the docs' example uses
    MPI ``Bcast`` of ``uid._data``), which is outside this module. Followed:
    ``initialization.html`` ("UID-based initialization") and ``core/init_fini.py``.
    """
    torch = require_torch()
    if uid is None:
        if nranks != 1:
            raise ConfigError("init_uid: several PEs need the unique id that rank 0 created and broadcast")
        uid = core.get_unique_id()
    try:
        from cuda.core import Device  # cuda.core >= 0.5 (what nvshmem4py 0.4 requires)
    except ImportError:  # older cuda.core keeps it under .experimental
        from cuda.core.experimental import Device
    dev = Device(torch.cuda.current_device() if device_index is None else device_index)
    dev.set_current()
    core.init(device=dev, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")


class _TorchStream:
    """A torch CUDA stream as nvshmem4py wants one: an object with ``__cuda_stream__() -> (0, handle)``."""

    __slots__ = ("stream",)

    def __init__(self, stream: Any):
        self.stream = stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, int(self.stream.cuda_stream))


class _Nvshmem:
    """The only code that calls the library (real ``nvshmem.core`` or :mod:`.fake_nvshmem`'s PE view).

    Keeping every call here means a renamed or re-ordered nvshmem4py function is a one-line fix.
    """

    def __init__(self, core: Any):
        self.core = core
        self.torch = require_torch()
        self.my_pe = int(core.my_pe())
        self.n_pes = int(core.n_pes())
        self._stream: Any = None  # set once the first tensor shows which device the heap is on
        self._lib_stream: Any = None

    def alloc(self, nbytes: int, dtype: Any = None) -> Any:
        torch = self.torch
        dtype = dtype or torch.uint8
        elem = torch.empty((), dtype=dtype).element_size()
        try:
            t = self.core.tensor((nbytes // elem,), dtype=dtype)
        except Exception as exc:  # the library's own error types; one clear error for the caller
            raise UnavailableError(
                f"nvshmem could not allocate {nbytes} B of symmetric memory (did every PE run nvshmem.core.init, "
                f"and is NVSHMEM_SYMMETRIC_SIZE large enough?): {exc}"
            ) from exc
        if self._stream is None and t.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=t.device)
            self._lib_stream = _TorchStream(self._stream)
        return t

    def free(self, t: Any) -> None:
        self.core.free_tensor(t)

    def signal_buffer(self, sig: Any) -> Any:
        return self.core.tensor_get_buffer(sig)[0]

    def write_local(self, dst: Any, data: bytes) -> None:
        """Host bytes -> the start of a local symmetric tensor, ordered before later puts on our stream."""
        torch = self.torch
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self._stream is None:
            dst[: len(data)].copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst[: len(data)].copy_(src)

    def read_local(self, src: Any, n: int) -> bytes:
        return src[:n].cpu().numpy().tobytes()

    def read_words(self, sigs: list[Any]) -> list[int]:
        """Current values of local signal words (one device-to-host copy for all of them)."""
        torch = self.torch
        return torch.cat([s.reshape(-1)[:1] for s in sigs]).tolist()

    def zero(self, sigs: list[Any]) -> None:
        for s in sigs:
            s.zero_()
        if self._stream is not None:
            self.torch.cuda.synchronize(self._stream.device)

    def put_signal(self, dst: Any, src: Any, sig: Any, value: int, pe: int) -> None:
        """``put_signal`` + ``quiet`` and wait: when this returns the data and the signal have landed."""
        core = self.core
        try:
            core.put_signal(dst, src, self.signal_buffer(sig), value, core.SignalOp.SIGNAL_SET, pe, stream=self._lib_stream)
            core.quiet(stream=self._lib_stream)
            if self._stream is not None:
                self._stream.synchronize()
        except Exception as exc:  # NvshmemError / NvshmemInvalid / CUDA errors: a failed transfer
            raise TransferError(f"nvshmem put_signal from PE {self.my_pe} to PE {pe} failed: {exc}") from exc

    def barrier_all(self) -> None:
        self.core.barrier_all(stream=self._lib_stream)
        if self._stream is not None:
            self._stream.synchronize()


class NvshmemPE:
    """This PE's symmetric slots and signal words (see the module docstring). Collective to build and close.

    ``core`` is ``nvshmem.core`` after :func:`init_uid` (or another ``init``), or a fake PE view from
    :class:`engines.attention.fake_nvshmem.FakeNvshmemWorld`. ``slot_bytes`` must be the same on every
    PE and bound every request and reply message (header included).
    """

    def __init__(self, core: Any, *, slot_bytes: int = 1 << 20):
        if slot_bytes < _HDR.size + 64 or slot_bytes % 8:
            raise ConfigError(f"slot_bytes must be a multiple of 8 and at least {_HDR.size + 64}, got {slot_bytes}")
        self.lib = _Nvshmem(core)
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
