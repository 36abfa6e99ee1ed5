"""The emulated vLLM v1 engine: block pool + KV manager + scheduler driven by a step-time profile.

:class:`EmulatedEngine` implements :class:`engines.base.EngineClient` in-process. Its step loop:
schedule (vLLM's algorithm, :mod:`engines.emulated.scheduler`) -> duration from the profile ->
sleep until the step's end on the running loop's clock -> apply (tokens, completions, KV events).
Time is read only from ``asyncio.get_running_loop().time()``, so the same engine runs in real time
(live HTTP wrapper) and on :mod:`gpuhit.vtime`'s virtual clock (simulation).

The step loop, completion and failure handling are :mod:`engines.emulated.step_loop` and
decode-only stretches are advanced in one jump (:mod:`engines.emulated.decode_jump`), both mixed in;
the CPU tier, remote store and PD transfers are :class:`engines.emulated.external_kv.ExternalKV`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from engines.base import EngineStats, GenerateRequest, GenerateResult
from engines.emulated.block_pool import BlockPool
from engines.emulated.decode_jump import DecodeJumpMixin
from engines.emulated.external_kv import ExternalKV
from engines.emulated.hash_map import ChainIdMap, HashMap
from engines.emulated.kv_manager import KVCacheManager, cdiv
from engines.emulated.kv_transfer import RemotePuller, TransferRegistry
from engines.emulated.metrics import EngineMetrics
from engines.emulated.profile import Profile, check_enough_kv_cache, load_profile
from engines.emulated.request import FINISHED, EmuRequest
from engines.emulated.scheduler import Scheduler
from engines.emulated.shared_host import SharedHost
from engines.emulated.stalls import StallSampler
from engines.emulated.step_loop import StepLoopMixin
from engines.emulated.tiers import CPUTier, RemoteStore
from engines.hashing import BlockHasher
from engines.keyed_hashes import KeyedHashes
from engines.kv_events import CPU, GPU, STORAGE, AllBlocksCleared, KVEventBatch
from gpuhit.errors import BadRequestError, CapacityError, ConfigError

KVEventCallback = Callable[[KVEventBatch], None]


def max_context_error(max_model_len: int, prompt_len: int, max_tokens: int) -> CapacityError:
    """vLLM's OpenAI-server message for a request longer than the context window."""
    return CapacityError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


class EmulatedEngine(StepLoopMixin, DecodeJumpMixin):
    """One emulated vLLM instance (see module docstring). ``name`` is its engine id."""

    def __init__(
        self,
        name: str,
        profile: Profile | str = "qwen3-coder-30b-a3b@h20",
        *,
        num_gpu_blocks: int | None = None,
        kv_capacity_bytes: float | None = None,
        block_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        cpu_offload_bytes: float = 0,
        remote_store_bytes: float = 0,
        remote_store: RemoteStore | None = None,
        transfer_registry: TransferRegistry | None = None,
        emit_token_ids: bool = True,
        jump_decode: bool = True,
        hash_name: str = "sha256",
        model_name: str | None = None,
        bootstrap_addr: str | None = None,
        util_bin_s: float = 1.0,
        remote_transfer: RemotePuller | None = None,
        scheduling_policy: str = "fcfs",
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        reserve_full_isl: bool = True,
        block_ids: str = "vllm",
        host: SharedHost | None = None,
        stalls: StallSampler | None = None,
    ):
        self.name = name
        # what the requests' block hashes are: vLLM's hashes, or the replayer's chain ids (virtual
        # time: replayer.synth), which the block pool then keeps in numpy pages (hash_map.py)
        if block_ids not in ("vllm", "chain"):
            raise ConfigError(f"block_ids must be 'vllm' or 'chain', got {block_ids!r}")
        self.block_ids = block_ids
        # vLLM's scheduler_reserve_full_isl (on by default in 0.32): admit a waiting request only
        # if blocks for all its tokens fit, not just for its first chunk
        self.reserve_full_isl = reserve_full_isl
        self.scheduling_policy = scheduling_policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.enable_prefix_caching = enable_prefix_caching
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        p = self.profile
        self.block_size = block_size or p.block_size
        derived_blocks = num_gpu_blocks is None  # explicit pool sizes (tests) skip vLLM's startup check
        if num_gpu_blocks is None:
            num_gpu_blocks = p.num_gpu_blocks(self.block_size, kv_capacity_bytes)
        elif kv_capacity_bytes is not None:
            raise ConfigError("give num_gpu_blocks or kv_capacity_bytes, not both")
        if num_gpu_blocks < 2:
            raise ConfigError(f"engine {name!r}: the KV cache needs at least 2 blocks, got {num_gpu_blocks}")
        self.max_num_batched_tokens = max_num_batched_tokens or p.max_num_batched_tokens
        self.max_num_seqs = max_num_seqs or p.max_num_seqs
        self.max_model_len = max_model_len or p.max_model_len
        if derived_blocks:  # vLLM refuses to start when one max_model_len request cannot fit
            check_enough_kv_cache(self.max_model_len, num_gpu_blocks, self.block_size, p.block_bytes(self.block_size))
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.block_bytes = p.block_bytes(self.block_size)
        self.emit_token_ids = emit_token_ids
        # a step's time depends on the other engines of a shared host while it runs: each step reads
        # their state, so a decode stretch cannot be advanced in one jump computed up front
        self.host = host
        if host is not None:
            host.join(self)
        # host stalls (engines.emulated.stalls): a stalled step's time is a draw, not a formula the
        # decode jump can sum ahead
        self.stalls = stalls
        self.jump_decode = jump_decode and host is None and (stalls is None or not stalls.model.steps)
        self.model_name = model_name or p.model.split(" ")[0]
        self.bootstrap_addr = bootstrap_addr or name
        self.hasher = BlockHasher(self.block_size, hash_name)
        self.cpu = CPUTier(int(cpu_offload_bytes // self.block_bytes), self.block_size) if cpu_offload_bytes else None
        if remote_store is not None and remote_store_bytes:
            raise ConfigError("give remote_store or remote_store_bytes, not both")
        if remote_store is None and remote_store_bytes:
            remote_store = RemoteStore(int(remote_store_bytes // self.block_bytes))
        self.remote = remote_store
        self.registry = transfer_registry if transfer_registry is not None else TransferRegistry()
        # Consumer side of cross-process PD transfers (engines.emulated.remote_transfer); None keeps
        # transfers in-process only, as in simulation, where no HTTP may happen. The engine owns it.
        self.remote_transfer = remote_transfer
        self._pull_tasks: set[asyncio.Task] = set()
        self.metrics = EngineMetrics(self.model_name, name, util_bin_s)
        self.external = ExternalKV(self.block_size, self.block_bytes, p, self.metrics,
                                   self.cpu, self.remote, self.registry)
        self._num_gpu_blocks = num_gpu_blocks
        self._subscribers: list[KVEventCallback] = []
        self._build_state()
        self._requests: dict[str, EmuRequest] = {}
        self._task: asyncio.Task | None = None
        self._waiter: asyncio.Future | None = None
        self._closed = False
        self._pending_aborts: list[EmuRequest] = []
        self.last_error: BaseException | None = None
        # the decode jump in flight: (requests, allocations, step ends, start, allocations applied)
        self._jump_state: list | None = None
        self.num_jumps = 0  # decode stretches advanced in one jump (speed diagnostics, tests)
        self.num_interrupted_jumps = 0

    def _build_state(self) -> None:
        self.pool = BlockPool(
            self._num_gpu_blocks, self.block_size, enable_events=bool(self._subscribers),
            on_evict=self.cpu.on_gpu_evict if self.cpu is not None else None,
            hash_map=ChainIdMap if self.block_ids == "chain" else HashMap,
        )
        self.kv = KVCacheManager(
            self.pool, emit_token_ids=self.emit_token_ids,
            on_cached=self.remote.write_through if self.remote is not None else None,
            enable_caching=self.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.kv, max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            external_lookup=self.external.lookup, policy=self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill, reserve_full_isl=self.reserve_full_isl,
        )

    # ---- EngineClient --------------------------------------------------------------------------
    async def generate(
        self, request: GenerateRequest, on_progress: Callable[[int], None] | None = None
    ) -> GenerateResult:
        """Run ``request`` to completion; failures come back as ``result.error``.

        ``on_progress(total_output_tokens)`` is called synchronously whenever tokens are produced.
        """
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._ensure_started(loop)
        result = GenerateResult(request_id=request.request_id, prompt_tokens=request.prompt_len, arrival=now)
        err = self._validate(request)
        if err is not None:
            result.error = str(err)
            self.metrics.request_errors += 1
            return result
        if request.block_hashes is not None:
            hashes: Any = request.block_hashes
            if type(hashes) is not KeyedHashes or len(hashes) > request.prompt_len // self.block_size:
                # a copy (the request may grow its own), and a KeyedHashes kept whole: its array goes with it
                hashes = hashes[: request.prompt_len // self.block_size]
        elif request.prompt_token_ids is not None:
            hashes = self.hasher.event_ints(request.prompt_token_ids[: request.prompt_len])
        else:
            hashes = ()
        fut = loop.create_future()
        req = EmuRequest(
            request.request_id, request.prompt_len, request.max_tokens, hashes,
            request.prompt_token_ids, now, fut, on_progress, request.kv_transfer_params,
            request.priority,
        )
        self._requests[req.request_id] = req
        if self.host is not None:  # its frontend's per-request CPU work, on the host's CPU model
            self.host.arrived(now)
        delay = self.profile.frontend_delay(request.prompt_len)
        if self.stalls is not None:  # the way in met a host stall (API server or engine core preempted)
            delay += self.stalls.request()
        if self.remote_transfer is not None and self.external.producer_elsewhere(request.kv_transfer_params):
            # The pull runs alongside the frontend delay, as vLLM's bootstrap query runs alongside
            # scheduling; the request joins the queue once both are over.
            task = loop.create_task(self._pull_then_enqueue(req, now + delay))
            self._pull_tasks.add(task)
            task.add_done_callback(self._pull_tasks.discard)
        elif delay > 0:
            loop.call_at(now + delay, self._enqueue, req)
        else:
            self._enqueue(req)
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(req.request_id)
            raise

    async def _pull_then_enqueue(self, req: EmuRequest, ready_at: float) -> None:
        """Pull the remote transfer into the local registry, then queue the request. A failed pull
        leaves the registry without the entry: ``ExternalKV.lookup`` counts the failure and the
        prompt is recomputed."""
        params = req.kv_transfer_params
        assert params is not None and self.remote_transfer is not None
        entry = await self.remote_transfer.pull(params, self.block_size, self.registry, self.block_bytes)
        if req.aborted or req.status == FINISHED:
            if entry is not None:  # nobody will load it: hand the producer its blocks back now
                claimed = self.registry.claim(entry.transfer_id)
                if claimed is not None:
                    claimed.release()
            return
        loop = asyncio.get_running_loop()
        if loop.time() < ready_at:
            loop.call_at(ready_at, self._enqueue, req)
        else:
            self._enqueue(req)

    def _validate(self, r: GenerateRequest) -> Exception | None:
        if r.request_id in self._requests:
            return BadRequestError(f"request id {r.request_id!r} is already in flight on engine {self.name!r}")
        if r.prompt_len < 1:
            return BadRequestError(f"prompt_len must be >= 1, got {r.prompt_len}")
        if r.max_tokens < 1:
            return BadRequestError(f"max_tokens must be >= 1, got {r.max_tokens}")
        if r.prompt_token_ids is not None and len(r.prompt_token_ids) < r.prompt_len:
            return BadRequestError(
                f"prompt_len {r.prompt_len} exceeds the {len(r.prompt_token_ids)} prompt_token_ids given")
        total = r.prompt_len + r.max_tokens
        if total > self.max_model_len:
            return max_context_error(self.max_model_len, r.prompt_len, r.max_tokens)
        need = cdiv(total, self.block_size)
        if need > self.pool.num_usable:
            return CapacityError(
                f"request needs {need} KV cache blocks ({r.prompt_len} prompt + {r.max_tokens} output tokens "
                f"at block size {self.block_size}) but engine {self.name!r} holds only {self.pool.num_usable}")
        params = r.kv_transfer_params
        if (params and (params.get("do_remote_prefill") or params.get("do_remote_decode"))
                and not params.get("transfer_id")):
            return BadRequestError("kv_transfer_params needs a transfer_id for do_remote_prefill/do_remote_decode")
        return None

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_usage=self.pool.usage(), kv_capacity_blocks=self.pool.num_usable, block_size=self.block_size,
        )

    def subscribe_kv_events(self, callback: KVEventCallback) -> None:
        self._subscribers.append(callback)
        self.pool.enable_events = True
        if self.cpu is not None:
            self.cpu.enable_events = True

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request (handled at the next step boundary); False if unknown."""
        req = self._requests.get(request_id)
        if req is None or req.aborted:
            return False
        req.aborted = True
        self._pending_aborts.append(req)
        self._notify()
        return True

    def cached_block_hashes(self, medium: str = GPU) -> set[int]:
        """The hashes cached now in one medium ("GPU", "CPU", "STORAGE")."""
        if medium == GPU:
            return self.pool.cached_hashes()
        if medium == CPU:
            return self.cpu.blocks.hashes() if self.cpu is not None else set()
        if medium == STORAGE:
            return self.remote.blocks.hashes() if self.remote is not None else set()
        raise ConfigError(f"unknown KV medium {medium!r}; use GPU, CPU or STORAGE")

    def utilization(self) -> float:
        """Busy time / elapsed loop time since the engine started."""
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            now = self._last_time
        return self.metrics.utilization(now)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``/reset_prefix_cache``: drop every cached GPU block; refused while blocks are in use."""
        if self.pool.num_free() != self.pool.num_usable:
            return False
        self.pool.reset_cache()
        if self.pool.enable_events:
            self.pool.events.append(AllBlocksCleared())
        self._publish(self._last_time)
        return True

    def render_prometheus(self) -> str:
        self._update_gauges()
        return self.metrics.render_prometheus()

    async def start(self) -> None:
        self._ensure_started(asyncio.get_running_loop())

    async def close(self) -> None:
        self._closed = True
        for t in list(self._pull_tasks):
            t.cancel()
        if self._pull_tasks:
            await asyncio.gather(*self._pull_tasks, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            # the step loop catches its own errors, so cancellation is the only way out
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in list(self._requests.values()):
            self._finish(req, self._last_time, f"engine {self.name!r} closed")
        if self.remote_transfer is not None:
            await self.remote_transfer.close()

    # ---- internals: queueing -------------------------------------------------------------------
    _last_time = 0.0

    def _ensure_started(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._task is None or self._task.done():
            if self._closed:
                raise BadRequestError(f"engine {self.name!r} is closed")
            if self.metrics.t0 is None:
                self.metrics.t0 = loop.time()
            self._task = loop.create_task(self._run(), name=f"emulated-engine-{self.name}")

    def _notify(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    def _enqueue(self, req: EmuRequest) -> None:
        if req.aborted or req.status == FINISHED:
            return
        req.queued_time = asyncio.get_running_loop().time()
        self.scheduler.add(req)
        self._notify()
