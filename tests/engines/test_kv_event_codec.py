"""vLLM KV-event wire format: both encodings, bytes hashes, malformed payloads."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from engines.kv_event_codec import decode_batch, decode_seq
from engines.kv_event_encode import CURRENT, END_SEQ, SHAPES, encode_batch, encode_seq
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventDecodeError
from engines.kv_raw_token_ids import RawTokenIds
from gpuhit.errors import EngineError

BATCH = KVEventBatch(
    ts=12.5,
    events=(
        BlockStored(
            block_hashes=(7322446309363477352, 17027874615116373601),
            parent_block_hash=None,
            token_ids=tuple(range(1000, 1032)),
            block_size=16,
            lora_id=None,
            medium="GPU",
        ),
        BlockRemoved(block_hashes=(7322446309363477352,), medium="GPU"),
        AllBlocksCleared(),
    ),
    data_parallel_rank=0,
)


@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip(shape):
    assert decode_batch(encode_batch(BATCH, shape)) == BATCH


def test_current_shape_is_vllm_map_encoding():
    doc = msgpack.unpackb(encode_batch(BATCH, CURRENT))
    assert doc["ts"] == 12.5 and doc["data_parallel_rank"] == 0
    stored = doc["events"][0]
    # msgspec tag=True: "type" is the class name; required None fields are present, defaults omitted.
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [7322446309363477352, 17027874615116373601],
        "parent_block_hash": None,
        "token_ids": list(range(1000, 1032)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    assert doc["events"][1] == {"type": "BlockRemoved", "block_hashes": [7322446309363477352], "medium": "GPU"}
    assert doc["events"][2] == {"type": "AllBlocksCleared"}


def test_older_array_shape_decodes():
    payload = msgpack.packb(
        [
            3.0,
            [
                ["BlockStored", [1, 2], 9, [5] * 32, 16, None, "CPU"],
                ["BlockStored", [3], 2, [6] * 16, 16, None],  # oldest: no medium
                ["BlockRemoved", [1]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 3.0 and batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored((1, 2), 9, tuple([5] * 32), 16, None, "CPU"),
        BlockStored((3,), 2, tuple([6] * 16), 16, None, None),
        BlockRemoved((1,), None),
        AllBlocksCleared(),
    )


def test_mixed_array_batch_with_map_events():
    payload = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"}], 2])
    assert decode_batch(payload) == KVEventBatch(1.0, (BlockRemoved((4,), "GPU"),), 2)


def test_bytes_hashes_normalise_to_event_ints():
    digest = hashlib.sha256(b"x").digest()
    payload = msgpack.packb(
        {"ts": 0.0, "events": [{"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": digest,
                                "token_ids": [1] * 16, "block_size": 16, "lora_id": None, "medium": "GPU",
                                "lora_name": None}]},
        use_bin_type=True,
    )
    ev = decode_batch(payload).events[0]
    want = int.from_bytes(digest[-8:], "big")
    assert ev.block_hashes == (want,) and ev.parent_block_hash == want


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb("hello"), "must be [ts, events"),
        (msgpack.packb([1.0, [["Bogus", 1]]]), "unknown KV event type 'Bogus'"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "without 'parent_block_hash'"),
        (msgpack.packb([1.0, [["BlockRemoved", ["x"]]]]), "must be an int or bytes"),
        (msgpack.packb(["t", []]), "ts must be a number"),
    ],
)
def test_malformed_payload_is_a_clear_engine_error(payload, fragment):
    with pytest.raises(KVEventDecodeError, match=fragment.replace("[", r"\[").replace("(", r"\(")) as info:
        decode_batch(payload)
    assert isinstance(info.value, EngineError)


def test_seq_frames():
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(2**40)) == 2**40
    assert END_SEQ == (-1).to_bytes(8, "big", signed=True)
    with pytest.raises(KVEventDecodeError):
        decode_seq(b"\x01")


def test_the_typed_fast_path_decodes_as_the_general_one_and_leaves_token_ids_raw_until_read(monkeypatch):
    import random

    from engines import kv_event_codec as codec

    rng = random.Random(5)
    for trial in range(40):
        events = []
        for _ in range(rng.randrange(1, 5)):
            kind = rng.random()
            if kind < 0.6:
                n = rng.choice([1, 15, 16, 17, 4096])
                toks = tuple(rng.randrange(0, 1 << rng.choice([7, 16, 31])) for _ in range(16 * n))
                events.append(BlockStored(tuple(rng.randrange(1 << 64) for _ in range(n)),
                                          rng.choice([None, rng.randrange(1 << 64)]), toks, 16, None,
                                          rng.choice(["GPU", "CPU"]), None, rng.choice([None, 1])))
            elif kind < 0.9:
                events.append(BlockRemoved(tuple(rng.randrange(1 << 64) for _ in range(rng.randrange(1, 9))), "GPU"))
            else:
                events.append(AllBlocksCleared())
        batch = KVEventBatch(float(trial), tuple(events), rng.choice([None, 0, 3]))
        payload = encode_batch(batch)
        fast = decode_batch(payload)
        assert fast.events and all(type(e.token_ids) is RawTokenIds for e in fast.events if type(e) is BlockStored)
        with monkeypatch.context() as m:
            m.setattr(codec, "_decode_current", lambda p: None)  # the general decoder alone
            general = decode_batch(payload)
        assert fast == general == batch
    # token ids of another type are taken as the general decoder takes them, not refused on first read
    odd = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
                                "token_ids": ["a", 2.5] * 8, "block_size": 16, "lora_id": None, "medium": "GPU",
                                "lora_name": None}]])
    fast = codec._decode_current(odd)
    assert fast is not None and fast.events[0].token_ids[:16] == ("a", 2.5) * 8
    with monkeypatch.context() as m:
        m.setattr(codec, "_decode_current", lambda p: None)
        assert fast == decode_batch(odd)
    # len and a chain's first block without decoding the rest
    ev = decode_batch(encode_batch(KVEventBatch(0.0, (BlockStored((1,), None, tuple(range(70_000)), 16),))))
    ids = ev.events[0].token_ids
    assert len(ids) == 70_000 and ids[:16] == tuple(range(16)) and ids._ids is None
    assert ids[69_999] == 69_999 and ids._ids is not None


def test_runs_of_one_block_removals_merge_into_one_event():
    """vLLM sends a BlockRemoved per evicted block; merged, each run of one medium and group is one
    event with the hashes in order, a stored block or another medium ending the run."""
    from engines import kv_event_codec as codec
    from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    stored = BlockStored((9,), None, tuple(range(16)), 16, medium="GPU", group_idx=0)
    events = (*(BlockRemoved((h,), "GPU", 0) for h in (1, 2, 3)), BlockRemoved((4,), "CPU", 0),
              BlockRemoved((5, 6), "CPU", 0), BlockRemoved((7,), "CPU", 1), stored, BlockRemoved((8,), "GPU", 0),
              AllBlocksCleared(), BlockRemoved((), "GPU", 0))
    want = (BlockRemoved((1, 2, 3), "GPU", 0), BlockRemoved((4, 5, 6), "CPU", 0), BlockRemoved((7,), "CPU", 1),
            stored, BlockRemoved((8,), "GPU", 0), AllBlocksCleared(), BlockRemoved((), "GPU", 0))
    batch = KVEventBatch(2.5, events, 0)
    assert codec.merge_removed(batch) == KVEventBatch(2.5, want, 0)
    payload = encode_batch(batch, "vllm")
    assert codec.decode_batch(payload) == batch  # unmerged unless asked
    assert codec.decode_batch(payload, merge=True) == KVEventBatch(2.5, want, 0)
