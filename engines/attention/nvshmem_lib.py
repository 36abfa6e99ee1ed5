"""nvshmem4py (``nvshmem.core``) as the NVSHMEM transport (:mod:`engines.attention.nvshmem_transport`)
uses it: loading it, UID-based init, and :class:`Nvshmem`, the one adapter every library call goes
through (the real ``nvshmem.core`` or :mod:`.fake_nvshmem`'s PE view behind it).

nvshmem4py calls (every one goes through :class:`Nvshmem`; names and argument orders as in the
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
``core/init_fini.py``); ``tests/perf/gpu_nvshmem_check.py`` runs this module and :mod:`engines.attention.nvshmem_transport`
against it on one GPU.
"""

from __future__ import annotations

from typing import Any

from engines.attention._torch import require_torch
from gpuhit.errors import ConfigError, TransferError, UnavailableError


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


class Nvshmem:
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
