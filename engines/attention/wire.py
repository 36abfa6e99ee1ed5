"""What travels between a requester and a KV holder, and its bytes: the query rows of a
:class:`RouteRequest` (q in the wire dtype, bf16 by default: d_qk x 2 B per row and head) and the
:class:`~engines.attention.partial.Partial` answering it (o in the wire dtype, m and l in fp32:
d_v x 2 + 8 B), as *Move the Query, Not the Cache* counts. One format for every transport
(:mod:`engines.attention.transports`, :mod:`engines.attention.nvshmem_transport`); a truncated or
foreign message is a :class:`~gpuhit.errors.TransferError`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.attention._torch import require_torch
from engines.attention.partial import Partial
from gpuhit.errors import BadRequestError, TransferError


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """Query rows routed to one holder. ``chunk_ids`` None means every chunk the holder has."""

    q: Any  # [Mq, Hq, d_qk]
    scale: float
    chunk_ids: tuple[str, ...] | None = None
    q_positions: Any = None  # [Mq] int64 for causal masking against the chunks' token positions


_DTYPES = ("float32", "bfloat16", "float16")
_REQ_HDR = struct.Struct("<4sBBHIIId")  # magic, dtype, has_pos, n_chunks, Mq, Hq, d_qk, scale
_PART_HDR = struct.Struct("<4sBIII")  # magic, dtype, Mq, Hq, d_v
_REQ_MAGIC = b"GHQ1"
_PART_MAGIC = b"GHP1"


def _dtype_code(torch: Any, dtype: Any) -> int:
    for i, name in enumerate(_DTYPES):
        if dtype == getattr(torch, name):
            return i
    raise BadRequestError(f"wire dtype must be one of {_DTYPES}, got {dtype}")


def _tensor_bytes(t: Any) -> bytes:
    return t.detach().contiguous().cpu().view(-1).view(require_torch().uint8).numpy().tobytes()


def _tensor_from(buf: bytes | memoryview, offset: int, dtype: Any, shape: Sequence[int]) -> tuple[Any, int]:
    torch = require_torch()
    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if offset + nbytes > len(buf):
        raise TransferError(f"truncated message: need {nbytes} bytes at offset {offset}, have {len(buf) - offset}")
    raw = bytearray(buf[offset : offset + nbytes])
    t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(*shape) if nbytes else torch.empty(*shape, dtype=dtype)
    return t, offset + nbytes


def encode_request(req: RouteRequest, wire_dtype: Any = None) -> bytes:
    """Serialize a request; q travels as ``wire_dtype`` (default: q's own dtype)."""
    torch = require_torch()
    q = req.q if wire_dtype is None else req.q.to(wire_dtype)
    mq, hq, d = (int(x) for x in q.shape)
    ids = b"" if req.chunk_ids is None else "\n".join(req.chunk_ids).encode()
    n_chunks = 0xFFFF if req.chunk_ids is None else len(req.chunk_ids)
    hdr = _REQ_HDR.pack(_REQ_MAGIC, _dtype_code(torch, q.dtype), req.q_positions is not None, n_chunks, mq, hq, d, req.scale)
    parts = [hdr, struct.pack("<I", len(ids)), ids, _tensor_bytes(q)]
    if req.q_positions is not None:
        parts.append(_tensor_bytes(torch.as_tensor(req.q_positions, dtype=torch.int64).reshape(mq)))
    return b"".join(parts)


def decode_request(buf: bytes | memoryview) -> RouteRequest:
    torch = require_torch()
    if len(buf) < _REQ_HDR.size + 4:
        raise TransferError("truncated route request")
    magic, dt, has_pos, n_chunks, mq, hq, d, scale = _REQ_HDR.unpack_from(buf, 0)
    if magic != _REQ_MAGIC or dt >= len(_DTYPES):
        raise TransferError("not a route request (bad magic or dtype)")
    off = _REQ_HDR.size
    (n_ids,) = struct.unpack_from("<I", buf, off)
    off += 4
    ids_raw = bytes(buf[off : off + n_ids])
    off += n_ids
    chunk_ids = None if n_chunks == 0xFFFF else (tuple(ids_raw.decode().split("\n")) if n_chunks else ())
    q, off = _tensor_from(buf, off, getattr(torch, _DTYPES[dt]), (mq, hq, d))
    pos = None
    if has_pos:
        pos, off = _tensor_from(buf, off, torch.int64, (mq,))
    return RouteRequest(q=q, scale=scale, chunk_ids=chunk_ids, q_positions=pos)


def encode_partial(p: Partial, wire_dtype: Any = None) -> bytes:
    """Serialize a partial: o as ``wire_dtype`` (default float32), m and l as float32."""
    torch = require_torch()
    o = p.o.to(wire_dtype or torch.float32)
    mq, hq, dv = (int(x) for x in o.shape)
    hdr = _PART_HDR.pack(_PART_MAGIC, _dtype_code(torch, o.dtype), mq, hq, dv)
    return b"".join([hdr, _tensor_bytes(o), _tensor_bytes(p.m.float()), _tensor_bytes(p.l.float())])


def decode_partial(buf: bytes | memoryview) -> Partial:
    torch = require_torch()
    if len(buf) < _PART_HDR.size:
        raise TransferError("truncated partial")
    magic, dt, mq, hq, dv = _PART_HDR.unpack_from(buf, 0)
    if magic != _PART_MAGIC or dt >= len(_DTYPES):
        raise TransferError("not a partial (bad magic or dtype)")
    off = _PART_HDR.size
    o, off = _tensor_from(buf, off, getattr(torch, _DTYPES[dt]), (mq, hq, dv))
    m, off = _tensor_from(buf, off, torch.float32, (mq, hq))
    l, off = _tensor_from(buf, off, torch.float32, (mq, hq))
    return Partial(o.float(), m, l)
