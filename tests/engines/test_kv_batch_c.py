"""The KV-event stage (engines/kv_event_codec.py BatchDecoder): the C decoder (gpuhit/_kvbatch.c)
against the msgspec reference on generated batches in every wire shape, merged and not, and on
corrupted payloads. Where the C decoder answers, its batch is the reference's; where the reference
raises, the C decoder answers None (counted as a fallback) and never a batch. vLLM's own batches:
tests/e2e/test_real_vllm_smoke.py."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.kv_event_codec import _C_CLASSES, BatchDecoder, decode_batch
from engines.kv_event_encode import ARRAY, CURRENT, VLLM, encode_batch
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventDecodeError
from engines.kv_raw_token_ids import RawTokenIds

HASH = st.integers(0, 2**64 - 1)
MEDIUM = st.sampled_from(["GPU", "CPU", None, "é"])
SMALL = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))


@st.composite
def stored(draw) -> BlockStored:
    n = draw(st.integers(0, 6))
    size = draw(st.sampled_from([1, 4, 16]))
    token = st.one_of(st.integers(0, 127), st.integers(0, 2**32 - 1), st.integers(-(2**63), 2**64 - 1))
    return BlockStored(tuple(draw(st.lists(HASH, min_size=n, max_size=n))), draw(st.one_of(st.none(), HASH)),
                       tuple(draw(st.lists(token, min_size=n * size, max_size=n * size))), size,
                       draw(SMALL), draw(MEDIUM), draw(st.sampled_from([None, "lora-a"])), draw(SMALL))


EVENT = st.one_of(
    stored(),
    st.builds(BlockRemoved, st.lists(HASH, max_size=4).map(tuple), MEDIUM, st.sampled_from([None, 0, 1])),
    st.builds(AllBlocksCleared, st.sampled_from([None, "GPU"])),
)
BATCH = st.builds(KVEventBatch, st.floats(allow_nan=False, allow_infinity=False), st.lists(EVENT, max_size=8).map(tuple),
                  st.sampled_from([None, 0, 3, -1]))
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _c(c_speedups, payload: bytes, merge: bool) -> KVEventBatch | None:
    return c_speedups.kv_batch(payload, _C_CLASSES, merge)


@SETTINGS
@given(batch=BATCH, shape=st.sampled_from([VLLM, CURRENT, ARRAY]), merge=st.booleans())
def test_the_c_decoder_gives_the_reference_batch(c_speedups, batch, shape, merge):
    payload = encode_batch(batch, shape)
    ref = decode_batch(payload, merge)
    fast = _c(c_speedups, payload, merge)
    if shape in (VLLM, CURRENT):  # vLLM's current shape: taken by the C decoder, token ids left raw
        assert fast is not None
        assert all(type(e.token_ids) is RawTokenIds for e in fast.events if type(e) is BlockStored)
    else:  # older array events: the reference's alone
        assert fast is None or not batch.events
    if fast is not None:
        assert fast == ref
        assert [type(e) for e in fast.events] == [type(e) for e in ref.events]
        assert fast.ts == ref.ts and fast.data_parallel_rank == ref.data_parallel_rank
    decoder = BatchDecoder(c_speedups)
    assert decoder.decode(payload, merge) == ref
    assert decoder.fallbacks == (fast is None)


@SETTINGS
@given(batch=BATCH, data=st.data())
def test_a_corrupt_payload_is_the_references_to_refuse(c_speedups, batch, data):
    payload = bytearray(encode_batch(batch, VLLM))
    op = data.draw(st.sampled_from(["cut", "flip", "append"]))
    if op == "cut":
        del payload[data.draw(st.integers(0, len(payload) - 1)):]
    elif op == "flip":
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    else:
        payload += bytes([data.draw(st.integers(0, 255))])
    payload = bytes(payload)
    try:
        ref: KVEventBatch | None = decode_batch(payload)
    except KVEventDecodeError:
        ref = None
    try:
        fast = _c(c_speedups, payload, False)
    except Exception as exc:  # noqa: BLE001 - the C decoder must answer None, never raise, for bad input
        pytest.fail(f"kv_batch raised {exc!r} on a corrupt payload")
    if fast is not None:
        assert ref is not None and fast == ref


@pytest.mark.parametrize("doc", [
    # digest-bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), negative hashes, extra keys, an
    # unknown field, a repeated key, token ids that are not ints, a map batch with another key
    [1.0, [{"type": "BlockStored", "block_hashes": [b"\x00" * 32], "parent_block_hash": None, "token_ids": [1] * 4,
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}]],
    [1.0, [{"type": "BlockRemoved", "block_hashes": [-5], "medium": "GPU"}]],
    [1.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [1] * 4,
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [["salt"]]}]],
    [1.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "novel": [1]}]],
    [1.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": ["a", 2.5],
            "block_size": 1, "lora_id": None, "medium": "GPU", "lora_name": None}]],
    {"ts": 1.0, "events": [], "other": 1},
])
def test_unusual_shapes_fall_back_to_the_reference(c_speedups, doc):
    payload = msgpack.packb(doc, use_bin_type=True)
    assert _c(c_speedups, payload, False) is None
    decoder = BatchDecoder(c_speedups)
    try:
        want: object = decode_batch(payload)
    except KVEventDecodeError as exc:
        want = type(exc)
    try:
        got: object = decoder.decode(payload)
    except KVEventDecodeError as exc:
        got = type(exc)
    assert got == want and decoder.fallbacks == 1


def test_a_repeated_key_falls_back(c_speedups):
    # {"type": "BlockRemoved", "block_hashes": [5], "block_hashes": [6]}: msgpack allows it, the C decoder does not
    event = (b"\x83" + msgpack.packb("type") + msgpack.packb("BlockRemoved") + msgpack.packb("block_hashes")
             + msgpack.packb([5]) + msgpack.packb("block_hashes") + msgpack.packb([6]))
    payload = b"\x92" + msgpack.packb(1.0) + b"\x91" + event
    assert _c(c_speedups, payload, False) is None
    assert decode_batch(payload).events[0].block_hashes in ((5,), (6,))
