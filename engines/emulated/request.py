"""The emulated engine's per-request record (vLLM's ``Request``, reduced to what scheduling needs).

No per-token objects: a request is counters plus its prompt's block hashes (64-bit event ints).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

WAITING = 0
RUNNING = 1
LOADING = 2  # vLLM's WAITING_FOR_REMOTE_KVS: external KV (CPU tier, remote store, PD transfer) in flight
FINISHED = 3


class EmuRequest:
    """Mutable scheduling state of one request inside one emulated engine."""

    __slots__ = (
        "aborted",
        "admitted",
        "arrival",
        "block_hashes",
        "cached_tokens",
        "external_tokens",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "future",
        "is_producer",
        "kv_transfer_params",
        "last_token_time",
        "load_hit",
        "load_release",
        "load_seconds",
        "max_tokens",
        "num_computed_tokens",
        "num_output_tokens",
        "num_preemptions",
        "on_progress",
        "output_chain",
        "priority",
        "prompt_len",
        "queued_time",
        "request_id",
        "result_params",
        "status",
        "token_ids",
        "transfer_tried",
    )

    def __init__(
        self,
        request_id: str,
        prompt_len: int,
        max_tokens: int,
        block_hashes: Sequence[int],
        token_ids: Sequence[int] | None,
        arrival: float,
        future: asyncio.Future | None,
        on_progress: Callable[[int], None] | None = None,
        kv_transfer_params: Mapping[str, Any] | None = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.block_hashes = block_hashes
        self.token_ids = token_ids
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.status = WAITING
        self.num_preemptions = 0
        self.arrival = arrival
        self.queued_time: float | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.cached_tokens = -1  # local GPU hit at first scheduling (-1: not scheduled yet)
        self.external_tokens = 0
        self.kv_transfer_params = kv_transfer_params
        self.result_params: dict[str, Any] | None = None
        self.future = future
        self.on_progress = on_progress
        self.aborted = False
        self.is_producer = bool(kv_transfer_params and kv_transfer_params.get("do_remote_decode"))
        self.load_seconds = 0.0
        # called once the external load has landed (releases a PD producer's pinned blocks)
        self.load_release: Callable[[], None] | None = None
        self.load_hit = None  # the ExternalHit being loaded
        self.transfer_tried = False  # the PD transfer was claimed (or found missing) once
        self.admitted = False  # first scheduling done (stats recorded once per request)
        # vLLM's priority scheduling: smaller first, then earlier arrival, then request id
        self.priority = priority
        # hashes the blocks that generated tokens fill, when those tokens are known (see OutputChain)
        self.output_chain: OutputChain | None = None

    def sort_key(self) -> tuple[int, float, str]:
        """vLLM's ``Request.__lt__`` order for the priority waiting queue."""
        return (self.priority, self.arrival, self.request_id)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output_tokens

    def __repr__(self) -> str:  # pragma: no cover
        return (
            f"EmuRequest({self.request_id!r}, prompt={self.prompt_len}, out={self.num_output_tokens}/"
            f"{self.max_tokens}, computed={self.num_computed_tokens}, status={self.status})"
        )


class OutputChain:
    """The tokens a request will generate, when known, and the chain digest to hash them on.

    vLLM hashes every full block of prompt *and* output tokens, so the blocks that decoding
    fills are cached (a BlockStored), reused when a preempted request comes back, and evicted
    like any other. The emulator does not know what a real model would generate, so by default
    it hashes prompt blocks only; given the tokens (the differential check against vLLM feeds
    both sides the same sampled tokens), :meth:`extend` grows ``block_hashes`` and ``token_ids``
    exactly as vLLM's request block hasher does after each sampled token.
    """

    __slots__ = ("digest", "hasher", "tokens")

    def __init__(self, hasher: Any, tokens: Sequence[int], digest: bytes | None):
        self.hasher = hasher  # engines.hashing.BlockHasher
        self.tokens = tokens  # prompt + output token ids
        self.digest = digest  # full digest of the last hashed block (None: none yet)

    def extend(self, req: EmuRequest) -> None:
        """Hash the full blocks of ``req``'s first ``num_tokens`` tokens not hashed yet."""
        bs = self.hasher.block_size
        hashes = req.block_hashes
        n = req.num_tokens // bs
        while len(hashes) < n:
            i = len(hashes)
            self.digest = self.hasher.hash_block(self.digest, self.tokens[i * bs:(i + 1) * bs])
            hashes.append(int.from_bytes(self.digest[-8:], "big"))
