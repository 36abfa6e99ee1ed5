"""vLLM's KV-event wire format (msgpack) <-> :class:`engines.kv_events.KVEventBatch`.

vLLM publishes each batch as one msgpack document, the third frame of ``[topic, seq, payload]``.
Its shape changed over releases (``vllm/distributed/kv_events.py``, msgspec structs):

* **current** (``EventBatch`` without ``array_like``, ``KVCacheEvent(tag=True, omit_defaults=True)``):
  the batch is a map ``{"ts", "events", "data_parallel_rank"}`` and every event a map whose
  ``"type"`` is the class name; required fields (``lora_id``, ``medium``, ``lora_name``) are always
  present, defaulted ones (``extra_keys``, ``group_idx``, ...) only when set.
* **array** (older releases, ``array_like=True`` everywhere): the batch is ``[ts, [events...]]`` or
  ``[ts, [events...], data_parallel_rank]`` and every event an array whose first element is the tag,
  ``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]`` (trailing fields
  absent in the oldest releases).

The decoder accepts both (and the mixed array-batch / map-event shape), so the gateway works in
front of any vLLM since KV events exist. Two implementations: the general decoder (the reference:
every shape, every error) and one fast path, msgspec's typed decoder for the current shape
(:func:`_decode_current`; vLLM 0.32 sends map events in an array batch), which keeps the token ids,
which routing never reads, as their raw msgpack bytes, decoded only if something asks for them
(:class:`RawTokenIds`): a 100k-token prompt's ``BlockStored`` then decodes in a tenth of the time.
Any payload those structs do not fit (the array shape, digest-bytes hashes, a corrupt one) goes
through the general decoder, which accepts it or raises the error it always did. Block hashes are 64-bit ints by default; with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` vLLM sends the raw digest bytes, which are normalised here
to the same int (last 8 bytes, big-endian) so that one index serves both.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Any

import msgpack
import msgspec

from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from gpuhit.errors import EngineError

CURRENT = "current"
ARRAY = "array"
VLLM = "vllm"  # what vLLM 0.32 itself sends (see encode_batch)
SHAPES = (VLLM, CURRENT, ARRAY)


class KVEventDecodeError(EngineError):
    """A KV-event payload that is not a vLLM event batch (corrupt, truncated, unknown event)."""

    code = "kv_event_decode_error"


# ---------------------------------------------------------------------------------------- encode


def _stored_map(ev: BlockStored) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(ev.block_hashes),
        "parent_block_hash": ev.parent_block_hash,
        "token_ids": list(ev.token_ids),
        "block_size": ev.block_size,
        "lora_id": ev.lora_id,
        "medium": ev.medium,
        "lora_name": ev.lora_name,
    }
    if ev.extra_keys is not None:  # omit_defaults: a defaulted field is left out
        out["extra_keys"] = [None if k is None else list(k) for k in ev.extra_keys]
    if ev.group_idx is not None:
        out["group_idx"] = ev.group_idx
    return out


def _event_current(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        return _stored_map(ev)
    if isinstance(ev, BlockRemoved):
        out: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
        if ev.group_idx is not None:
            out["group_idx"] = ev.group_idx
        return out
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {ev!r}")


def _event_array(ev: KVEvent) -> list[Any]:
    if isinstance(ev, BlockStored):
        out: list[Any] = [
            "BlockStored",
            list(ev.block_hashes),
            ev.parent_block_hash,
            list(ev.token_ids),
            ev.block_size,
            ev.lora_id,
            ev.medium,
        ]
        if ev.lora_name is not None or ev.group_idx is not None or ev.extra_keys is not None:
            out.append(ev.lora_name)
        if ev.extra_keys is not None or ev.group_idx is not None:
            out.append(None if ev.extra_keys is None else [None if k is None else list(k) for k in ev.extra_keys])
        if ev.group_idx is not None:
            out.append(ev.group_idx)
        return out
    if isinstance(ev, BlockRemoved):
        out = ["BlockRemoved", list(ev.block_hashes), ev.medium]
        if ev.group_idx is not None:
            out.append(ev.group_idx)
        return out
    if isinstance(ev, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {ev!r}")


def _event_vllm(ev: KVEvent) -> dict[str, Any]:
    """A map event as vLLM 0.32 fills it: a BlockStored also carries one nil ``extra_keys`` entry per
    block when it has none, and its cache group's ``kv_cache_spec_kind`` (fields the decoders read
    as absent and ignore)."""
    out = _event_current(ev)
    if type(ev) is BlockStored:
        if ev.extra_keys is None:
            out["extra_keys"] = [None] * len(ev.block_hashes)
        out["kv_cache_spec_kind"] = "full_attention"
    return out


def encode_batch(batch: KVEventBatch, shape: str = CURRENT) -> bytes:
    """The msgpack payload vLLM would publish for ``batch`` (``shape``: ``vllm`` (0.32's own: an
    array batch of map events), ``current`` (the map batch) or ``array``)."""
    if shape == VLLM:
        doc: Any = [batch.ts, [_event_vllm(e) for e in batch.events]]
        if batch.data_parallel_rank is not None:
            doc.append(batch.data_parallel_rank)
    elif shape == CURRENT:
        doc = {"ts": batch.ts, "events": [_event_current(e) for e in batch.events]}
        if batch.data_parallel_rank is not None:
            doc["data_parallel_rank"] = batch.data_parallel_rank
    elif shape == ARRAY:
        doc = [batch.ts, [_event_array(e) for e in batch.events]]
        if batch.data_parallel_rank is not None:
            doc.append(batch.data_parallel_rank)
    else:
        raise ValueError(f"unknown KV event shape {shape!r}; choose one of {SHAPES}")
    return msgpack.packb(doc, use_bin_type=True)


# ---------------------------------------------------------------------------------------- decode


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


class RawTokenIds(Sequence[int]):
    """A ``BlockStored``'s token ids, decoded from their msgpack bytes on first use.

    ``len``, iteration, indexing, slicing, comparison (with a tuple or another ``RawTokenIds``)
    and hashing answer as for the decoded tuple. Elements decode as the general decoder takes them
    (whatever msgpack holds), so both paths give the same event for the same payload. msgspec skips
    these bytes without checking their strings, so a corrupt payload can hold ids that do not
    decode: reading them then raises :class:`KVEventDecodeError` (the C decoder, which checks every
    id is an int, hands such a payload to msgspec).
    """

    __slots__ = ("_ids", "_raw")

    def __init__(self, raw: msgspec.Raw | memoryview):
        self._raw: msgspec.Raw | memoryview | None = raw
        self._ids: tuple[int, ...] | None = None

    def ids(self) -> tuple[int, ...]:
        if self._ids is None:
            assert self._raw is not None  # held until the ids are decoded
            try:
                self._ids = tuple(_TOKEN_IDS.decode(self._raw))
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                raise KVEventDecodeError(f"BlockStored.token_ids do not decode: {exc}") from None
            self._raw = None
        return self._ids

    def __len__(self) -> int:
        if self._ids is None:  # the array header's count: no decoding
            raw = memoryview(self._raw)[:5].tobytes()  # type: ignore[arg-type]
            head = raw[0]
            return head - 0x90 if head < 0xA0 else int.from_bytes(raw[1:3 if head == 0xDC else 5], "big")
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if self._ids is None and isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1) \
                and i.stop is not None and 0 <= i.stop <= 256:
            # a leading few (the hash check reads a chain's first block): decode just those
            u = msgpack.Unpacker()
            u.feed(self._raw)
            k = min(u.read_array_header(), i.stop)
            try:
                return tuple(u.unpack() for _ in range(k))
            except UnicodeDecodeError as exc:
                raise KVEventDecodeError(f"BlockStored.token_ids do not decode: {exc}") from None
        return self.ids()[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RawTokenIds):
            other = other.ids()
        return self.ids() == other if isinstance(other, tuple) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.ids())

    def __repr__(self) -> str:
        return repr(self.ids())


_TOKEN_IDS = msgspec.msgpack.Decoder()  # untyped, as the general decoder's tuple(token_ids)

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
            if memoryview(e.token_ids)[:1].tobytes() not in _ARRAY_HEADS:
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


# msgpack array headers (fixarray, array 16, array 32): token_ids must be an array to take the fast path
_ARRAY_HEADS = frozenset([bytes([0x90 + k]) for k in range(16)] + [b"\xdc", b"\xdd"])


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


def decode_batch(payload: bytes, merge: bool = False) -> KVEventBatch:
    """Decode one published payload; raises :class:`KVEventDecodeError` on anything else. ``merge``:
    runs of removals as one event (:func:`merge_removed`)."""
    batch = _decode(payload)
    return merge_removed(batch) if merge else batch


def _decode(payload: bytes) -> KVEventBatch:
    fast = _decode_current(payload)
    if fast is not None:
        return fast
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for corrupt input
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


def encode_seq(seq: int) -> bytes:
    """A batch sequence number as vLLM sends it: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


def decode_seq(raw: bytes) -> int:
    if len(raw) != 8:
        raise KVEventDecodeError(f"KV event sequence frame must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


# The replay socket's end-of-replay marker: seq -1 as signed 8 bytes (= b"\xff" * 8).
END_SEQ = b"\xff" * 8

