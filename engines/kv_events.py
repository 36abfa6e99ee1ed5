"""KV cache events in vLLM's shape (``vllm/distributed/kv_events.py``), as plain frozen dataclasses.

The emulated engine emits these; the gateway's precise KV index consumes them; the ZMQ codec
(``engines.kv_event_codec``) turns them into and out of vLLM's msgpack wire format. Hashes are the
64-bit ints vLLM publishes by default (see :mod:`engines.hashing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPU = "GPU"
CPU = "CPU"
STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = GPU
    lora_name: str | None = None
    group_idx: int | None = None
    # vLLM's per-block extra hash keys (LoRA name, multimodal ids, cache_salt), None when no block has
    # any: a block with extra keys hashes differently from its tokens alone.
    extra_keys: tuple | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published batch: vLLM's ``KVEventBatch(ts, events, data_parallel_rank)``."""

    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
    data_parallel_rank: int | None = None
