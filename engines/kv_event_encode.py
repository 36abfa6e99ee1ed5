"""vLLM's KV-event wire format, written: :class:`engines.kv_events.KVEventBatch` -> the msgpack
payload vLLM publishes, in each shape vLLM has used (:mod:`engines.kv_event_codec` reads them all
back), and the sequence frame beside it.

The emulated engine publishes through this (as vLLM 0.32 does: :data:`VLLM`), and the tests build
payloads of every shape with it.
"""

from __future__ import annotations

from typing import Any

import msgpack

from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

CURRENT = "current"
ARRAY = "array"
VLLM = "vllm"  # what vLLM 0.32 itself sends (see encode_batch)
SHAPES = (VLLM, CURRENT, ARRAY)



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


def encode_seq(seq: int) -> bytes:
    """A batch sequence number as vLLM sends it: 8 bytes, big-endian."""
    return seq.to_bytes(8, "big")


# The replay socket's end-of-replay marker: seq -1 as signed 8 bytes (= b"\xff" * 8).
END_SEQ = b"\xff" * 8
