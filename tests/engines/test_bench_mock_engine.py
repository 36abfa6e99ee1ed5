"""The router benchmark's mock engine (tests/perf/mock_engine.py) announces what vLLM would: its lazy
LRU evicts what an OrderedDict LRU evicts, and its spliced KV-event payloads are byte for byte what
``encode_batch`` makes of the same events with their token ids."""

from __future__ import annotations

import random
from collections import OrderedDict

import msgpack
import numpy as np
import orjson

from engines.hashing import BlockHasher
from engines.kv_event_codec import decode_batch
from engines.kv_event_encode import VLLM, encode_batch
from engines.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tests.perf import mock_engine
from tests.perf.mock_engine import BLOCK_SIZE, _Store, msgpack_uints


class _Pub:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, parts: list[bytes]) -> None:
        self.sent.append(parts)


def test_msgpack_uints_packs_as_msgpack_does():
    rng = np.random.default_rng(5)
    edges = [0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1]
    for n in (0, 1, 15, 16, 17, 65535, 65536, 70_000):
        ids = rng.choice(np.array(edges, dtype=np.uint64), n) if n % 2 else \
            rng.integers(0, 1 << int(rng.integers(1, 64)), n, dtype=np.uint64)
        assert msgpack_uints(ids) == msgpack.packb(ids.tolist()), n


def _body(ids: list[int]) -> bytes:
    return orjson.dumps({"model": "m", "prompt": ids, "max_tokens": 4})


def test_lazy_lru_and_payloads_equal_the_plain_ones():
    """Prompts sharing prefixes (hits, partial hits, repeats) through a small cache, published every
    few prompts: each batch decodes to the events an OrderedDict LRU gives, with the full token ids,
    and is the bytes encode_batch gives for those events."""
    rng = random.Random(2)
    hasher = BlockHasher(BLOCK_SIZE)
    pub = _Pub()
    store = _Store(pub, capacity=40)
    ref: OrderedDict[int, None] = OrderedDict()
    roots = [[rng.randrange(300_000) for _ in range(BLOCK_SIZE * rng.randrange(1, 12))] for _ in range(6)]
    expected: list[list] = [[]]
    for step in range(300):
        base = rng.choice(roots)
        ids = base[: BLOCK_SIZE * rng.randrange(0, len(base) // BLOCK_SIZE + 1)]
        ids = ids + [rng.randrange(1 << 20) for _ in range(rng.choice([0, 0, 5, BLOCK_SIZE * rng.randrange(1, 5)]))]
        store.on_prompt(_body(ids), None)
        hs = hasher.event_ints(ids)
        k = next((j for j, h in enumerate(hs) if h not in ref), len(hs))
        for h in hs[:k]:
            ref.move_to_end(h)
        if k < len(hs):
            ref.update(dict.fromkeys(hs[k:]))
            evicted = [ref.popitem(last=False)[0] for _ in range(max(0, len(ref) - 40))]
            expected[-1].append(BlockStored(tuple(hs[k:]), hs[k - 1] if k else None,
                                            tuple(ids[k * BLOCK_SIZE: len(hs) * BLOCK_SIZE]), BLOCK_SIZE,
                                            medium="GPU", group_idx=0))
            if evicted:
                expected[-1].append(BlockRemoved(tuple(evicted), medium="GPU", group_idx=0))
        assert set(store.stamp) == set(ref), step
        if step % 3 == 2:
            store.publish()
            expected.append([])
    store.publish()
    batches = [e for e in expected if e]
    assert len(pub.sent) == len(batches) > 50
    for parts, events in zip(pub.sent, batches):
        got = decode_batch(parts[2])
        assert list(got.events) == events
        assert parts[2] == encode_batch(KVEventBatch(got.ts, tuple(events), 0), VLLM)
    assert store.listed >= len(store.stamp)


def test_hit_only_prompts_do_not_grow_the_listing_without_bound():
    store = _Store(_Pub(), capacity=1000)
    body = _body(list(range(BLOCK_SIZE * 50)))
    for _ in range(3000):
        store.on_prompt(body, None)
    assert len(store.stamp) == 50
    assert store.listed <= 2 * 50 + 65536 + 50


def test_a_large_body_takes_the_fast_parse_and_publishes_its_ids():
    """Bodies of 64 KiB and more are parsed by gateway.http.prompt.fast_completion_ids (lazily in
    pure Python): the published token ids are still the prompt's, behind a cached prefix too."""
    rng = np.random.default_rng(9)
    ids = rng.integers(100_000, 1 << 20, 12_000).tolist()
    body = _body(ids)
    assert len(body) >= mock_engine.FAST_PARSE_MIN_BYTES
    pub = _Pub()
    store = _Store(pub)
    store.on_prompt(_body(ids[:4_000]), None)
    store.on_prompt(body, None)
    store.publish()
    (first, second), = [decode_batch(parts[2]).events for parts in pub.sent]  # one step, two prompts
    assert type(first) is type(second) is BlockStored
    assert first.token_ids == tuple(ids[:4_000])
    assert second.parent_block_hash == first.block_hashes[-1]  # the first prompt's blocks were hits
    assert second.token_ids == tuple(ids[4_000:12_000 // BLOCK_SIZE * BLOCK_SIZE])
