"""An in-process fake of the nvshmem4py subset the NVSHMEM query transport uses: a test double, not a transport.

Why it exists: nvshmem4py needs CUDA GPUs and one process per PE, so the protocol of
:mod:`engines.attention.nvshmem_transport` (slots, signal words, sequence numbers, error replies) could
otherwise only run on a multi-GPU launch. Here several PEs live in one process, each PE's symmetric
heap is a list of CPU tensors, and ``put`` / ``put_signal`` copy between PEs with NVSHMEM's semantics
as nvshmem4py exposes them (the source checked against NVIDIA/nvshmem ``nvshmem4py/nvshmem/core``):

- symmetric allocation: the k-th live ``tensor()`` on every PE is the same symmetric object, so a
  local tensor names the remote PE's copy of it (the "symmetric address");
- a tensor given to ``put`` / ``tensor_get_buffer`` must be the *start* of an allocation
  (nvshmem4py looks a tensor up by ``data_ptr()``; a slice at an offset raises), and the transfer
  moves ``min(dst allocation, src allocation)`` bytes, whatever view of them was passed;
- ``put_signal`` writes the data, then sets (or adds to) the remote 64-bit signal word; the signal
  must be a *buffer* (``tensor_get_buffer(t)[0]``) of at least 8 bytes, as in ``nvshmem.core.rma``;
- fresh allocations hold garbage (here 0xA5 bytes), not zeros, as ``nvshmem_malloc`` memory does, so
  code that forgets to zero its signal words fails under the fake too.

What it does not model: streams (operations complete at once; ``stream`` is accepted and ignored),
blocking collectives (``barrier_all`` cannot wait for PEs that run in the same thread, so it only
checks the heaps are symmetric), GPU memory, and timing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engines.attention._torch import require_torch

__all__ = ["FakeBuffer", "FakeNvshmemCore", "FakeNvshmemError", "FakeNvshmemWorld"]

_GARBAGE = 0xA5


class FakeNvshmemError(RuntimeError):
    """What nvshmem4py's ``NvshmemInvalid`` / ``NvshmemError`` would be: a misuse of the library."""


class SignalOp(enum.IntEnum):
    """Mirrors ``nvshmem.core.SignalOp`` (``nvshmem_signal_op_t``)."""

    SIGNAL_SET = 9
    SIGNAL_ADD = 10


class ComparisonType(enum.IntEnum):
    """Mirrors ``nvshmem.core.ComparisonType`` (``nvshmemx_cmp_type_t``); kept for API shape."""

    CMP_EQ = 0
    CMP_NE = 1
    CMP_GT = 2
    CMP_LE = 3
    CMP_LT = 4
    CMP_GE = 5


@dataclass(frozen=True, slots=True)
class FakeBuffer:
    """Stands for a ``cuda.core`` Buffer of the symmetric heap: (PE, allocation index, size)."""

    pe: int
    index: int
    size: int


class FakeNvshmemWorld:
    """``n_pes`` PEs in this process; :meth:`core` is PE ``pe``'s view, shaped like ``nvshmem.core``."""

    def __init__(self, n_pes: int):
        if n_pes < 1:
            raise FakeNvshmemError(f"a world needs at least one PE, got {n_pes}")
        self.n_pes = n_pes
        # heaps[pe][k]: PE pe's k-th allocation (None once freed); symmetric across PEs by index
        self.heaps: list[list[Any]] = [[] for _ in range(n_pes)]
        self.puts = 0
        self.signals = 0
        self._cores = [FakeNvshmemCore(self, pe) for pe in range(n_pes)]

    def core(self, pe: int) -> FakeNvshmemCore:
        return self._cores[pe]

    def _remote(self, pe: int, index: int, size: int) -> Any:
        if not 0 <= pe < self.n_pes:
            raise FakeNvshmemError(f"remote PE {pe} out of range [0, {self.n_pes})")
        heap = self.heaps[pe]
        t = heap[index] if index < len(heap) else None
        if t is None or t.numel() * t.element_size() != size:
            raise FakeNvshmemError(
                f"symmetric object {index} is not allocated alike on PE {pe}: every PE must allocate the same "
                "sizes in the same order"
            )
        return t


class FakeNvshmemCore:
    """One PE's ``nvshmem.core``: the functions the transport calls, with nvshmem4py's argument order."""

    SignalOp = SignalOp
    ComparisonType = ComparisonType

    def __init__(self, world: FakeNvshmemWorld, pe: int):
        self._world = world
        self._pe = pe

    # --- direct.py ------------------------------------------------------------------------------
    def my_pe(self) -> int:
        return self._pe

    def n_pes(self) -> int:
        return self._world.n_pes

    # --- interop/torch.py -----------------------------------------------------------------------
    def tensor(self, shape: tuple[int, ...], dtype: Any = None, release: bool = False) -> Any:
        torch = require_torch()
        dtype = dtype or torch.float32
        n = 1
        for s in shape:
            n *= int(s)
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        raw = torch.full((nbytes,), _GARBAGE, dtype=torch.uint8)
        t = raw.view(dtype).view(*shape)
        self._world.heaps[self._pe].append(t)
        return t

    def tensor_get_buffer(self, tensor: Any) -> tuple[FakeBuffer, int, str]:
        index = self._index_of(tensor)
        return FakeBuffer(self._pe, index, self._nbytes(index)), tensor.numel() * tensor.element_size(), str(tensor.dtype)

    def free_tensor(self, tensor: Any) -> None:
        self._world.heaps[self._pe][self._index_of(tensor)] = None

    # --- rma.py ---------------------------------------------------------------------------------
    def put(self, dst: Any, src: Any, remote_pe: int = -1, stream: Any = None) -> None:
        self._put(dst, src, remote_pe)

    def put_signal(
        self, dst: Any, src: Any, signal_var: Any, signal_val: int, signal_op: Any, remote_pe: int = -1, stream: Any = None
    ) -> None:
        if not isinstance(signal_var, FakeBuffer) or signal_var.size < 8:
            raise FakeNvshmemError("Signal must be a Buffer >= 8 bytes allocated by NVSHMEM4Py")
        self._put(dst, src, remote_pe)
        self._signal(signal_var, signal_val, signal_op, remote_pe)

    def signal_op(self, signal_var: Any, signal_val: int, signal_op: Any, remote_pe: int = -1, stream: Any = None) -> None:
        if not isinstance(signal_var, FakeBuffer) or signal_var.size < 8:
            raise FakeNvshmemError("Signal must be a Buffer >= 8 bytes allocated by NVSHMEM4Py")
        self._signal(signal_var, signal_val, signal_op, remote_pe)

    def quiet(self, stream: Any = None) -> None:
        """Every fake operation completed when it returned: nothing to wait for."""

    # --- collective.py --------------------------------------------------------------------------
    def barrier_all(self, stream: Any = None) -> None:
        """Cannot block (all PEs share one thread); checks the heaps are symmetric so far instead."""
        sizes = [[None if t is None else t.numel() * t.element_size() for t in h] for h in self._world.heaps]
        mine = sizes[self._pe]
        for pe, other in enumerate(sizes):
            common = min(len(mine), len(other))
            if mine[:common] != other[:common]:
                raise FakeNvshmemError(f"symmetric heaps of PE {self._pe} and PE {pe} differ: {mine} vs {other}")

    # --- internals ------------------------------------------------------------------------------
    def _index_of(self, tensor: Any) -> int:
        ptr = tensor.data_ptr()
        for i, t in enumerate(self._world.heaps[self._pe]):
            if t is not None and t.data_ptr() == ptr:
                return i
        raise FakeNvshmemError("Tried to retrieve buffer from Tensor not tracked by nvshmem (not the start of an allocation)")

    def _nbytes(self, index: int) -> int:
        t = self._world.heaps[self._pe][index]
        return t.numel() * t.element_size()

    def _put(self, dst: Any, src: Any, remote_pe: int) -> None:
        torch = require_torch()
        d, s = self._index_of(dst), self._index_of(src)
        # nvshmem4py moves min(dst buffer, src buffer) bytes of the whole allocations (rma._call_putget)
        n = min(self._nbytes(d), self._nbytes(s))
        remote = self._world._remote(remote_pe, d, self._nbytes(d))
        src_bytes = self._world.heaps[self._pe][s].reshape(-1).view(torch.uint8)
        remote.reshape(-1).view(torch.uint8)[:n].copy_(src_bytes[:n])
        self._world.puts += 1

    def _signal(self, sig: FakeBuffer, value: int, op: Any, remote_pe: int) -> None:
        torch = require_torch()
        remote = self._world._remote(remote_pe, sig.index, sig.size)
        word = remote.reshape(-1).view(torch.uint8)[:8].view(torch.int64)
        if int(op) == int(SignalOp.SIGNAL_SET):
            word[0] = int(value)
        elif int(op) == int(SignalOp.SIGNAL_ADD):
            word[0] += int(value)
        else:
            raise FakeNvshmemError(f"unknown signal op {op!r}")
        self._world.signals += 1
