"""The router's and engines' messages and the KV events are frozen ``msgspec.Struct`` records: what the code relies on
of them (immutability, value equality and hashing, defaults, copies with changes, pickling for Ray
sweeps) holds for every one of them."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from engines.base import EngineStats, GenerateRequest
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from gateway.router import RouteRecord, RouteRequest
from policies.snapshot import Decision, InstanceState, RequestView, Snapshot

EXAMPLES = [
    InstanceState(0, "e0", in_flight=2, gpu_hit_blocks=3),
    RequestView("r1", 100, 6, 16, 8, "s"),
    Snapshot(1.5, RequestView("r1", 100, 6, 16), (InstanceState(0, "e0"), InstanceState(1, "e1")), binding=1),
    Decision("forward", 1, "why", scores=((0, 2.0), (1, 1.0))),
    RouteRequest("r1", 100, 8, (1, 2, 3), session_id="s"),
    RouteRecord("r1", "s", "lpwl", "forward", 1, None, "why", ((1, 1.0),), 3, 2.0),
    GenerateRequest("r1", 100, 8, block_hashes=(1, 2)),
    EngineStats(running=1, kv_usage=0.5),
    BlockStored((1, 2), None, tuple(range(32)), 16, medium="GPU", group_idx=0),
    BlockRemoved((3,), medium="CPU"),
    AllBlocksCleared(),
    KVEventBatch(1.0, (BlockRemoved((3,)), AllBlocksCleared()), 0),
]


@pytest.mark.parametrize("rec", EXAMPLES, ids=lambda r: type(r).__name__)
def test_frozen_equal_hashable_replaceable_picklable(rec):
    name = msgspec.structs.fields(rec)[0].name
    with pytest.raises(AttributeError):
        setattr(rec, name, None)
    copy = msgspec.structs.replace(rec)
    assert copy == rec and copy is not rec and hash(copy) == hash(rec)
    assert pickle.loads(pickle.dumps(rec)) == rec
    changed = msgspec.structs.replace(rec, **{name: "other"})
    assert changed != rec and getattr(changed, name) == "other"
    assert not hasattr(rec, "__dict__")  # slotted: no per-instance dict


def test_defaults_and_keywords():
    d = Decision("forward", 0, "r")
    assert (d.source, d.scores, d.priority, d.predicted_hit_blocks) == (None, (), None, 0)
    assert InstanceState(index=1, name="x").role == "both"
    with pytest.raises(TypeError):
        InstanceState(0)  # a required field stays required
    with pytest.raises(TypeError):
        EngineStats(1, 2, 0.5, 10, 16, 99)  # no more positional arguments than fields


def test_snapshot_hit_tokens_caps_as_vllm_does():
    # 4 blocks of 16 cached, 64-token prompt: vLLM never serves the last prompt token from cache.
    snap = Snapshot(0.0, RequestView("r", 64, 4, 16), (InstanceState(0, "e0", gpu_hit_blocks=4),))
    assert snap.hit_tokens(0) == 48
