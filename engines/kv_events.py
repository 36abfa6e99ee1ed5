"""KV cache events in vLLM's shape (``vllm/distributed/kv_events.py``), as frozen ``msgspec.Struct``
records (as vLLM's own are; constructed in C: a frozen dataclass's ``__init__`` cost ~2 us per event).

The emulated engine emits these; the gateway's precise KV index consumes them; the ZMQ codec
(``engines.kv_event_encode``, ``engines.kv_event_codec``) turns them into and out of vLLM's msgpack
wire format. Hashes are the
64-bit ints vLLM publishes by default (see :mod:`engines.hashing`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gpuhit.errors import EngineError

GPU = "GPU"
CPU = "CPU"
STORAGE = "STORAGE"


class BlockStored(msgspec.Struct, frozen=True):
    # a tuple; an engine with chain ids (virtual time) publishes its int64 array (block_pool.py)
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    # A tuple, or the decoder's RawTokenIds (decoded on first use): a Sequence either way. (These
    # records are built, never msgspec's decode target, so the annotation decodes nothing.)
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = GPU
    lora_name: str | None = None
    group_idx: int | None = None
    # vLLM's per-block extra hash keys (LoRA name, multimodal ids, cache_salt), None when no block has
    # any: a block with extra keys hashes differently from its tokens alone.
    extra_keys: tuple | None = None


class BlockRemoved(msgspec.Struct, frozen=True):
    block_hashes: tuple[int, ...]  # as in BlockStored
    medium: str | None = GPU
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True):
    """One published batch: vLLM's ``KVEventBatch(ts, events, data_parallel_rank)``."""

    ts: float
    events: tuple[KVEvent, ...] = ()
    data_parallel_rank: int | None = None


class KVEventDecodeError(EngineError):
    """A KV-event payload that is not a vLLM event batch (corrupt, truncated, unknown event)."""

    code = "kv_event_decode_error"
