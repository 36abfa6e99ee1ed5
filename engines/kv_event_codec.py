"""vLLM's KV-event wire format, read: one published msgpack payload -> :class:`engines.kv_events.KVEventBatch`.

vLLM publishes each batch as one msgpack document, the third frame of ``[topic, seq, payload]``.
Its shape changed over releases (``vllm/distributed/kv_events.py``, msgspec structs):

* **current** (``EventBatch`` without ``array_like``, ``KVCacheEvent(tag=True, omit_defaults=True)``):
  the batch is a map ``{"ts", "events", "data_parallel_rank"}`` and every event a map whose
  ``"type"`` is the class name; required fields (``lora_id``, ``medium``, ``lora_name``) are always
  present, defaulted ones (``extra_keys``, ``group_idx``, ...) only when set. vLLM 0.32 sends these
  map events in an array batch ``[ts, [events...], data_parallel_rank]``.
* **array** (older releases, ``array_like=True`` everywhere): the batch is ``[ts, [events...]]`` or
  ``[ts, [events...], data_parallel_rank]`` and every event an array whose first element is the tag,
  ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]`` (trailing fields
  absent in the oldest releases).

Two implementations, chosen once where the gateway is built (:class:`BatchDecoder`):

* the **reference**, msgspec (every install has it): :func:`decode_batch`. The current shape goes
  through msgspec's typed decoder (:func:`_decode_current`), which leaves the token ids, which
  routing never reads, as raw msgpack (:class:`engines.kv_raw_token_ids.RawTokenIds`); anything
  those structs do not fit (the array shape, digest-bytes hashes, extra keys, a corrupt payload) is
  decoded untyped and checked field by field, which accepts it or raises
  :class:`~engines.kv_events.KVEventDecodeError`.
* the **fast path**, C (``make compile``: ``kv_batch`` in ``gpuhit/_kvbatch.c``), for the current
  shape only: it skips the token ids by a table of int sizes and builds the records in C. Anything
  else it answers None for, and the reference decides (counted in :attr:`BatchDecoder.fallbacks`).

Block hashes are 64-bit ints by default; with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` vLLM sends
the raw digest bytes, which are normalised here to the same int (last 8 bytes, big-endian) so that
one index serves both. Writing payloads: :mod:`engines.kv_event_encode`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from types import ModuleType
from typing import Annotated, Any

import msgspec

from engines.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
)
from engines.kv_raw_token_ids import ARRAY_HEADS, RawTokenIds

# ------------------------------------------------------------------------ the reference, untyped

_ANY = msgspec.msgpack.Decoder()  # any msgpack document (maps with any hashable keys)


def _hash(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        # vLLM sends unsigned 64-bit ints; a signed encoder could send the same bits negative.
        return value & 0xFFFFFFFFFFFFFFFF
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise KVEventDecodeError(f"{what}: empty hash bytes")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise KVEventDecodeError(f"{what}: block hash must be an int or bytes, got {type(value).__name__}")


def _hashes(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise KVEventDecodeError(f"{what}: block_hashes must be an array, got {type(value).__name__}")
    # Fast path (the default wire form): non-negative ints pass through; anything else is normalised.
    return tuple([v if type(v) is int and v >= 0 else _hash(v, what) for v in value])


def _opt_int(value: Any, what: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KVEventDecodeError(f"{what} must be an int or nil, got {type(value).__name__}")


def _opt_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KVEventDecodeError(f"{what} must be a string or nil, got {type(value).__name__}")


def _stored(f: Mapping[str, Any]) -> BlockStored:
    try:
        hashes = f["block_hashes"]
        parent = f["parent_block_hash"]
        token_ids = f["token_ids"]
        block_size = f["block_size"]
    except KeyError as exc:
        raise KVEventDecodeError(f"BlockStored without {exc.args[0]!r}") from None
    if not isinstance(token_ids, (list, tuple)):
        raise KVEventDecodeError("BlockStored.token_ids must be an array")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise KVEventDecodeError(f"BlockStored.block_size must be a positive int, got {block_size!r}")
    return BlockStored(
        block_hashes=_hashes(hashes, "BlockStored"),
        parent_block_hash=None if parent is None else _hash(parent, "BlockStored.parent_block_hash"),
        token_ids=tuple(token_ids),
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), "BlockStored.lora_id"),
        medium=_opt_str(f.get("medium"), "BlockStored.medium"),
        lora_name=_opt_str(f.get("lora_name"), "BlockStored.lora_name"),
        group_idx=_opt_int(f.get("group_idx"), "BlockStored.group_idx"),
        extra_keys=_extra_keys(f.get("extra_keys")),
    )


def _extra_keys(value: Any) -> tuple | None:
    """vLLM's per-block ``extra_keys`` list, kept only when some block has keys (None otherwise)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise KVEventDecodeError(f"BlockStored.extra_keys must be an array or nil, got {type(value).__name__}")
    if all(k is None for k in value):
        return None
    return tuple(None if k is None else tuple(k) if isinstance(k, (list, tuple)) else (k,) for k in value)


def _removed(f: Mapping[str, Any]) -> BlockRemoved:
    if "block_hashes" not in f:
        raise KVEventDecodeError("BlockRemoved without 'block_hashes'")
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], "BlockRemoved"),
        medium=_opt_str(f.get("medium"), "BlockRemoved.medium"),
        group_idx=_opt_int(f.get("group_idx"), "BlockRemoved.group_idx"),
    )


# Positional field order of vLLM's array_like structs (after the tag).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_TAGS = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))


def decode_event(raw: Any) -> KVEvent:
    """One event in either encoding."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        fields: Mapping[str, Any] = raw
    elif isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
        if tag not in _TAGS:
            raise KVEventDecodeError(f"unknown KV event type {tag!r}")
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        if len(raw) - 1 > len(names):
            raise KVEventDecodeError(f"{tag} event has {len(raw) - 1} fields, at most {len(names)} known")
        fields = dict(zip(names, raw[1:]))
    else:
        raise KVEventDecodeError(f"KV event must be a map or a tagged array, got {raw!r:.80}")
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        return _removed(fields)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(medium=_opt_str(fields.get("medium"), "AllBlocksCleared.medium"))
    raise KVEventDecodeError(f"unknown KV event type {tag!r}")


# ------------------------------------------------------------------- the reference, typed (current)

# A plain hash: a non-negative int, checked by msgspec as it decodes (a negative one, or digest
# bytes, fails the typed decode and the general decoder normalises it).
_Hash = Annotated[int, msgspec.Meta(ge=0)]


class _Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: msgspec.Raw
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    medium: str | None = None


class _Batch(msgspec.Struct):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(_Batch, array_like=True):
    """vLLM 0.32 on the wire: ``[ts, [event maps...], data_parallel_rank]``."""


_BATCHES = (msgspec.msgpack.Decoder(_ArrayBatch), msgspec.msgpack.Decoder(_Batch))


def _decode_current(payload: bytes) -> KVEventBatch | None:
    """Map events in an array batch (what vLLM 0.32 sends) or a map batch, through msgspec's typed
    decoder; None when the payload is not exactly that with plain int hashes (the general decoder
    then takes it)."""
    for dec in _BATCHES:
        try:
            b = dec.decode(payload)
            break
        except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec raises the latter for a bad tag string
            continue
    else:
        return None
    out: list[KVEvent] = []
    for e in b.events:
        if type(e) is _Stored:
            if memoryview(e.token_ids)[:1].tobytes() not in ARRAY_HEADS:
                return None
            out.append(BlockStored(
                block_hashes=tuple(e.block_hashes), parent_block_hash=e.parent_block_hash,
                token_ids=RawTokenIds(e.token_ids), block_size=e.block_size, lora_id=e.lora_id,
                medium=e.medium, lora_name=e.lora_name, group_idx=e.group_idx,
                extra_keys=_extra_keys(e.extra_keys),
            ))
        elif type(e) is _Removed:
            out.append(BlockRemoved(block_hashes=tuple(e.block_hashes), medium=e.medium, group_idx=e.group_idx))
        else:
            out.append(AllBlocksCleared(medium=e.medium))
    return KVEventBatch(ts=b.ts, events=tuple(out), data_parallel_rank=b.data_parallel_rank)


def _decode(payload: bytes) -> KVEventBatch:
    """The reference: the typed decoder for the current shape, the untyped one for the rest."""
    typed = _decode_current(payload)
    if typed is not None:
        return typed
    try:
        doc = _ANY.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise KVEventDecodeError(f"KV event payload is not msgpack: {exc}") from None
    if isinstance(doc, Mapping):
        ts, events, rank = doc.get("ts"), doc.get("events"), doc.get("data_parallel_rank")
    elif isinstance(doc, (list, tuple)) and len(doc) in (2, 3):
        ts, events = doc[0], doc[1]
        rank = doc[2] if len(doc) == 3 else None
    else:
        raise KVEventDecodeError(f"KV event batch must be [ts, events(, rank)] or a map, got {doc!r:.80}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise KVEventDecodeError(f"KV event batch ts must be a number, got {ts!r:.40}")
    if not isinstance(events, (list, tuple)):
        raise KVEventDecodeError(f"KV event batch events must be an array, got {type(events).__name__}")
    return KVEventBatch(
        ts=float(ts),
        events=tuple(decode_event(e) for e in events),
        data_parallel_rank=_opt_int(rank, "data_parallel_rank"),
    )


def decode_batch(payload: bytes, merge: bool = False) -> KVEventBatch:
    """Decode one published payload with the reference; raises :class:`KVEventDecodeError` on
    anything that is not a vLLM event batch. ``merge``: runs of removals as one event
    (:func:`merge_removed`)."""
    batch = _decode(payload)
    return merge_removed(batch) if merge else batch


def merge_removed(batch: KVEventBatch) -> KVEventBatch:
    """``batch`` with each run of consecutive ``BlockRemoved`` events of one medium and group as one
    event, their hashes in order. vLLM sends one ``BlockRemoved`` per evicted block, so once a cache
    is full every stored block brings a removal event; a reader that treats removals as set
    differences (the precise index; the hash check skips them) gets the same answer from one record
    a run."""
    out: list[KVEvent] = []
    for key, run in itertools.groupby(batch.events, _removal_run):
        if key is None:
            out.extend(run)
        else:
            out.append(BlockRemoved(tuple(h for ev in run for h in ev.block_hashes), *key))
    return KVEventBatch(batch.ts, tuple(out), batch.data_parallel_rank)


def _removal_run(ev: KVEvent) -> tuple[str | None, int | None] | None:
    """What makes consecutive removals one run (their medium and group); None for other events."""
    return (ev.medium, ev.group_idx) if type(ev) is BlockRemoved else None


# ---------------------------------------------------------------------------------- the decoder

_C_CLASSES = (KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared, RawTokenIds)


class BatchDecoder:
    """The KV-event stage as one subscriber runs it: the C decoder when ``accel`` (the C speedups,
    :func:`gpuhit.speedups.load`) is given, else the reference. ``fallbacks`` counts the payloads
    the C decoder handed to the reference (anything outside vLLM's current shape), which then
    decodes them or raises: the batch is the reference's either way."""

    __slots__ = ("_c", "fallbacks")

    def __init__(self, accel: ModuleType | None = None):
        self._c = None if accel is None else accel.kv_batch
        self.fallbacks = 0

    @property
    def fast(self) -> bool:
        """Whether the C decoder runs."""
        return self._c is not None

    def decode(self, payload: bytes, merge: bool = False) -> KVEventBatch:
        """:func:`decode_batch`, through the C decoder where it takes the payload."""
        if self._c is not None:
            batch = self._c(payload, _C_CLASSES, merge)
            if batch is not None:
                return batch
            self.fallbacks += 1
        return decode_batch(payload, merge)


def decode_seq(raw: bytes) -> int:
    """A batch sequence frame (8 bytes, big-endian: :func:`engines.kv_event_encode.encode_seq`)."""
    if len(raw) != 8:
        raise KVEventDecodeError(f"KV event sequence frame must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")
