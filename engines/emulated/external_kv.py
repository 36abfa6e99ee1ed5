"""The emulated engine's KV from outside its GPU pool: the CPU tier, the remote store and PD
transfers, as vLLM's KV connectors see them.

:class:`ExternalKV` answers the scheduler's external lookup (how many of a request's next blocks
the tiers and a waiting transfer hold, and how long loading them takes per the profile), starts the
loads the scheduler admitted, and registers a finished PD producer's blocks for its consumer. The
engine owns the step loop, the pool and the requests; this part gets the tiers, the transfer
registry, the profile and the metrics it counts into.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from engines.emulated.kv_transfer import TransferRegistry, is_http_addr
from engines.emulated.metrics import EngineMetrics
from engines.emulated.profile import Profile
from engines.emulated.request import EmuRequest
from engines.emulated.scheduler import ExternalHit
from engines.emulated.tiers import CPUTier, RemoteStore
from engines.hashing import common_prefix_len


class ExternalKV:
    """The external tiers and transfers of one engine."""

    def __init__(self, block_size: int, block_bytes: int, profile: Profile,
                 metrics: EngineMetrics, cpu: CPUTier | None, remote: RemoteStore | None,
                 registry: TransferRegistry):
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.profile = profile
        self.metrics = metrics
        self.cpu = cpu
        self.remote = remote
        self.registry = registry

    def producer_elsewhere(self, params: Mapping[str, Any] | None) -> bool:
        """A consumer request whose producer is not in this process (its transfer is not in the
        in-process registry and its bootstrap address is an HTTP URL): its blocks must be pulled."""
        if not params or not params.get("do_remote_prefill"):
            return False
        return (is_http_addr(params.get("remote_bootstrap_addr"))
                and self.registry.peek(str(params.get("transfer_id"))) is None)

    def lookup(self, req: EmuRequest, n_local: int) -> ExternalHit | None:
        """The scheduler's external lookup: the blocks after the ``n_local`` locally cached tokens
        that the CPU tier, then the remote store, then a waiting PD transfer hold, and their load
        time. A consumer whose transfer is missing counts a transfer failure and recomputes."""
        bs = self.block_size
        hashes = req.block_hashes
        max_blocks = min((req.num_tokens - 1) // bs, len(hashes))
        pos = n_local // bs
        cpu_n = remote_n = transfer_n = 0
        tid = None
        params = req.kv_transfer_params
        consumer = bool(params and params.get("do_remote_prefill")) and not req.transfer_tried
        if pos < max_blocks:
            if self.cpu is not None:
                cpu_n = self.cpu.blocks.prefix_run(hashes, pos, max_blocks)
                pos += cpu_n
            if self.remote is not None and pos < max_blocks:
                remote_n = self.remote.blocks.prefix_run(hashes, pos, max_blocks)
                pos += remote_n
        if consumer:
            assert params is not None
            tid = str(params["transfer_id"])
            entry = self.registry.peek(tid)
            if entry is None:
                req.transfer_tried = True
                self.metrics.kv_transfer_failures += 1
                tid = None
            else:
                transfer_n = common_prefix_len(entry.block_hashes, hashes, pos, max_blocks)
                if transfer_n == 0:  # nothing to pull: hand the producer its blocks back now
                    req.transfer_tried = True
                    claimed = self.registry.claim(tid)
                    if claimed is not None:
                        claimed.release()
                    tid = None
        m = self.metrics
        tokens = (cpu_n + remote_n + transfer_n) * bs
        if self.cpu is not None or self.remote is not None or consumer:
            m.external_prefix_cache_queries += req.num_tokens
            m.external_prefix_cache_hits += tokens
        if tokens == 0:
            return None
        bb = self.block_bytes
        prof = self.profile
        load = 0.0
        if cpu_n:
            load += prof.cpu_load_time(cpu_n * bb)
        if remote_n:
            load += prof.remote_load_time(remote_n * bb)
        if transfer_n:
            load += prof.transfer_time(transfer_n * bb)
        return ExternalHit(tokens, load, cpu_n, remote_n, transfer_n, tokens // bs * bb, tid)

    def start_loads(self, reqs: list[EmuRequest], now: float, on_done: Callable[[EmuRequest], None]) -> None:
        """Start the loads the scheduler admitted: touch the tiers' blocks, claim the transfers,
        count the bytes; ``on_done(r)`` runs at ``now`` plus each request's load time."""
        loop = asyncio.get_running_loop()
        bs = self.block_size
        bb = self.block_bytes
        m = self.metrics
        for r in reqs:
            hit: ExternalHit = r.load_hit
            start_blk = (r.num_computed_tokens - hit.tokens) // bs
            if hit.cpu_blocks:
                assert self.cpu is not None
                self.cpu.blocks.touch_run(r.block_hashes, start_blk, start_blk + hit.cpu_blocks)
                m.cpu_load_bytes += hit.cpu_blocks * bb
            if hit.remote_blocks:
                assert self.remote is not None
                self.remote.blocks.touch_run(r.block_hashes, start_blk + hit.cpu_blocks,
                                             start_blk + hit.cpu_blocks + hit.remote_blocks)
                m.remote_load_bytes += hit.remote_blocks * bb
                self.remote.bytes_loaded += hit.remote_blocks * bb
                self.remote.blocks_loaded += hit.remote_blocks
            if hit.transfer_id is not None:
                r.transfer_tried = True
                entry = self.registry.claim(hit.transfer_id)
                if entry is not None:
                    r.load_release = entry.release
                nbytes = hit.transfer_blocks * bb
                m.kv_transfers += 1
                m.kv_transfer_bytes += nbytes
                m.kv_transfer_seconds += self.profile.transfer_time(nbytes)
            loop.call_at(now + r.load_seconds, on_done, r)

    def pin_for_transfer(self, r: EmuRequest, engine_id: str, bootstrap_addr: str, block_ids: tuple[int, ...],
                         release: Callable[[], None]) -> None:
        """A finished PD producer: register its prompt's blocks (``block_ids``, freed by ``release``
        once the consumer has them) and set the consumer's kv_transfer_params as its result. The
        engine passes its id and bootstrap address now: a live server sets the address once it
        knows its port."""
        params: Mapping[str, Any] = r.kv_transfer_params or {}
        tid = str(params["transfer_id"])
        n_full = min(r.prompt_len // self.block_size, len(r.block_hashes))
        hashes = tuple(r.block_hashes[:n_full])
        self.registry.register(tid, engine_id, hashes, block_ids, r.prompt_len, release)
        r.result_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id,
            "remote_bootstrap_addr": bootstrap_addr,
            "remote_block_ids": list(block_ids),
            "transfer_id": tid,
            "num_tokens": r.prompt_len,
        }
