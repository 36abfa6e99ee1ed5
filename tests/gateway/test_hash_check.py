"""The gateway re-hashes chain-start blocks of the engines' KV events and reports a mismatch."""

from __future__ import annotations

import logging

from engines.hashing import BlockHasher
from engines.kv_events import BlockStored, KVEventBatch
from gateway.hash_check import HashVerifier


def _batch(hasher: BlockHasher, tokens: list[int], parent: int | None = None, **kw) -> KVEventBatch:
    ints = hasher.event_ints(tokens)
    return KVEventBatch(0.0, (BlockStored(tuple(ints), parent, tuple(tokens), hasher.block_size, **kw),))


def test_matching_engine_is_ok_and_mismatch_is_loud(caplog):
    gw = BlockHasher(32, "sha256")
    v = HashVerifier(gw, ["a", "b"])
    toks = list(range(64))
    v.observe(0, _batch(gw, toks))
    v.observe(0, _batch(gw, toks[:32], parent=123))  # continuation: parent digest unknown, not checked
    seeded = BlockHasher(32, "sha256", seed="0")  # an engine started with PYTHONHASHSEED=0
    with caplog.at_level(logging.WARNING):
        v.observe(1, _batch(seeded, toks))
        v.observe(1, _batch(seeded, toks[32:]))
    a, b = v.state()
    assert (a["checked"], a["mismatches"], a["ok"]) == (1, 0, True)
    assert (b["checked"], b["mismatches"], b["ok"]) == (2, 2, False)
    assert "--hash-seed" in b["last_mismatch"]
    assert sum("KV hash mismatch with engine b" in r.message for r in caplog.records) == 1  # once per engine
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    metrics.extra.append(v.render)
    text = metrics.render()  # through prometheus_client, as /metrics renders it
    assert 'gpuhit_gateway_kv_hash_checks_total{instance="b",outcome="mismatch"} 2.0' in text
    assert 'gpuhit_gateway_kv_hash_checks_total{instance="a",outcome="match"} 1.0' in text


def test_block_size_and_extra_keys():
    gw = BlockHasher(32)
    v = HashVerifier(gw, ["a"])
    other = BlockHasher(16)
    v.observe(0, _batch(other, list(range(32))))
    salted = _batch(gw, list(range(32)), extra_keys=(("salt",),))
    v.observe(0, salted)  # hashed with extra keys: not reproducible from tokens, skipped
    st = v.state()[0]
    assert (st["block_size_mismatches"], st["checked"], st["ok"]) == (1, 0, False)


def test_after_the_first_chains_one_in_check_every_is_rehashed_and_a_change_is_still_caught():
    from gateway.hash_check import CHECK_EVERY, CHECK_FIRST

    gw = BlockHasher(16)
    v = HashVerifier(gw, ["a"])
    starts = CHECK_FIRST + 3 * CHECK_EVERY
    for k in range(starts):
        v.observe(0, _batch(gw, [k] * 16))
    st = v.state()[0]
    assert (st["chain_starts"], st["checked"], st["mismatches"]) == (starts, CHECK_FIRST + 3, 0)
    # the engine restarts with another seed: every chain now mismatches, and the sample meets one
    seeded = BlockHasher(16, seed="0")
    for k in range(CHECK_EVERY):
        v.observe(0, _batch(seeded, [k] * 16))
    st = v.state()[0]
    assert st["mismatches"] == 1 and st["ok"] is False and st["checked"] == CHECK_FIRST + 4


def test_token_ids_that_do_not_decode_are_reported_not_raised():
    """A corrupt payload can reach the checker with token ids msgspec skipped unchecked (a string of
    bad UTF-8 among them): the check says so and goes on; nothing is counted as checked."""
    import msgpack

    from engines.kv_event_codec import decode_batch

    gw = BlockHasher(16, "sha256")
    v = HashVerifier(gw, ["a"])
    bad = msgpack.packb([0.0, [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
                                "token_ids": [1] * 15 + ["x"], "block_size": 16, "lora_id": None,
                                "medium": "GPU", "lora_name": None}]]).replace(b"\xa1x", b"\xa1\xff")
    v.observe(0, decode_batch(bad))
    (a,) = v.state()
    assert a["checked"] == 0 and "token ids do not decode" in a["last_mismatch"]
