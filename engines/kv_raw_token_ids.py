"""A ``BlockStored``'s token ids kept as their msgpack bytes until something reads them.

Routing reads a KV event's block hashes and never its token ids (the hash check reads one chain's
first block): a 100k-token prompt's ``BlockStored`` carries 100k ids that both KV-event decoders
(:mod:`engines.kv_event_codec`) leave undecoded, as a :class:`RawTokenIds` over the payload.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgpack
import msgspec

from engines.kv_events import KVEventDecodeError


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

# msgpack array headers (fixarray, array 16, array 32): what a token_ids value must start with
ARRAY_HEADS = frozenset([bytes([0x90 + k]) for k in range(16)] + [b"\xdc", b"\xdd"])
