"""Step-time profiles: how long one engine step takes on a given model and GPU.

A step's duration (vLLM v1 runs prefill chunks and decodes in one forward pass)::

    step = step_overhead_s                         # launch, sampling, weights read once
         + per_seq_overhead_s * num_seqs
         + sum over prefill chunks (n new tokens after c context tokens):
               prefill_chunk_overhead_s + prefill_per_token_s * n + prefill_attn_s * ((c + n)^2 - c^2)
         + decode_per_ctx_token_s * sum of decoding sequences' contexts   # KV read, memory-bound

so a full prefill of L tokens costs ``a*L + b*L^2`` plus one chunk overhead per chunk. The chunk
overhead is what a sequence in prefill costs a step beyond a decoding one (its inputs prepared and
copied, attention metadata for a query longer than one token): small on a GPU, several
milliseconds on the CPU build, where a one-block prefill takes twice a batch-1 decode step. Before a request reaches
the scheduler it spends ``frontend_overhead_s + frontend_per_token_s * prompt_len`` in the API
server (HTTP, input processing); that time is not GPU time. Loads from lower tiers cost
``overhead + bytes / bandwidth``. Engines that share a host's cores (the CPU build) take longer per
step while the host's other engines work too: ``host_contention`` holds the measured factor by the
count of busy engines (:mod:`engines.emulated.shared_host`), or ``host_cpu`` the CPU costs that time
a step by the host's CPU demand (:mod:`engines.emulated.host_cpu`). Profiles are data (``profiles.json``),
each citing its sources.
"""

from __future__ import annotations

import bisect
import json
import pathlib
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from engines.emulated.host_cpu import HostCPU, host_cpu_of
from engines.emulated.stalls import Stalls, stalls_of
from gpuhit.errors import ConfigError

PROFILES_PATH = pathlib.Path(__file__).with_name("profiles.json")
# The profile every command uses unless told otherwise: the model and GPU that the *GPU-Hit-First*
# note measured (README "References").
DEFAULT_PROFILE = "qwen3-coder-30b-a3b@h20"


#: decode stretches up to this many steps are summed in Python (see Profile.decode_step_ends)
_SHORT_STRETCH = 64


@dataclass(frozen=True, slots=True)
class Profile:
    """One model on one GPU. Times in seconds, bandwidths in GB/s (1e9 bytes/s)."""

    name: str
    model: str
    gpu: str
    kv_bytes_per_token: int
    gpu_kv_capacity_bytes: int
    max_model_len: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    step_overhead_s: float = 0.01
    per_seq_overhead_s: float = 0.0
    prefill_per_token_s: float = 5e-5
    prefill_attn_s: float = 0.0
    prefill_chunk_overhead_s: float = 0.0
    decode_per_ctx_token_s: float = 0.0
    frontend_overhead_s: float = 0.0
    frontend_per_token_s: float = 0.0
    pcie_gbps: float = 25.0
    cpu_load_overhead_s: float = 0.0
    nic_gbps: float = 10.0
    transfer_overhead_s: float = 0.0
    remote_gbps: float = 7.0
    remote_load_overhead_s: float = 0.0
    # optional measured effective remote-store throughput by transfer size: ((bytes, GB/s), ...),
    # interpolated linearly in bytes and clamped at the ends; replaces remote_gbps when given
    remote_gbps_by_bytes: tuple[tuple[float, float], ...] = ()
    # optional measured slowdown of a step by the number of engines busy on the same host: entry i is
    # the factor with i + 1 busy (the first is 1.0), and its length is how many engines share a host
    # (engines.emulated.shared_host); empty: every engine has the host to itself
    host_contention: tuple[float, ...] = ()
    # optional measured CPU costs of the host's engines and frontends (engines.emulated.host_cpu):
    # when given, a step is timed by the host's CPU demand at that moment instead of host_contention
    host_cpu: HostCPU | None = None
    # optional measured host stalls (engines.emulated.stalls): rare long delays of steps and of
    # requests' way in, drawn per engine from the run's seed; None: every step as its cost says
    stalls: Stalls | None = None
    sources: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()
    fit: dict[str, Any] = field(default_factory=dict)

    # ---- derived -------------------------------------------------------------------------------
    def block_bytes(self, block_size: int | None = None) -> int:
        return self.kv_bytes_per_token * (block_size or self.block_size)

    def num_gpu_blocks(self, block_size: int | None = None, capacity_bytes: float | None = None) -> int:
        """Blocks of the pool for a KV capacity (default: the profile's), plus vLLM's null block."""
        cap = self.gpu_kv_capacity_bytes if capacity_bytes is None else capacity_bytes
        return int(cap // self.block_bytes(block_size)) + 1

    # ---- costs ---------------------------------------------------------------------------------
    def prefill_cost(self, n: int, context: int) -> float:
        """GPU time of ``n`` new prompt tokens computed after ``context`` cached/computed ones, in one
        chunk. (0.0 + x is x exactly: profiles without a chunk overhead time steps as before.)"""
        return self.prefill_chunk_overhead_s + self.prefill_per_token_s * n + self.prefill_attn_s * (n * (2 * context + n))

    def step_time(self, num_seqs: int, prefill_cost: float, decode_ctx_sum: int) -> float:
        """Duration of one step (see module docstring). Keep the expression order fixed: the
        decode-jump path relies on it being bit-identical to the step-by-step path."""
        return (
            self.step_overhead_s
            + self.per_seq_overhead_s * num_seqs
            + prefill_cost
            + self.decode_per_ctx_token_s * decode_ctx_sum
        )

    def decode_step_ends(self, start: float, num_seqs: int, decode_ctx_sum: int, k: int) -> list[float] | np.ndarray:
        """End times of ``k`` decode-only steps of a fixed batch from ``start``: step ``j`` (from 0)
        lasts ``step_time(num_seqs, 0.0, decode_ctx_sum + num_seqs * j)`` and ends where the next
        begins. Long stretches in numpy, bit-identical to summing :meth:`step_time` one step at a
        time (the decode jump relies on it): the same operations in the same order on float64
        (contexts are exact below 2**53), and ``np.add.accumulate`` adds in sequence, not pairwise;
        they stay a float64 array (the jump reads a few ends and hands the rest to the ITL
        histogram as an array: a list of thousands of floats would be made and unmade). Short ones
        by that sum itself, as a list: below ~64 steps a handful of numpy calls costs more."""
        if k <= _SHORT_STRETCH:
            ends, t = [], start
            for j in range(k):
                t = t + self.step_time(num_seqs, 0.0, decode_ctx_sum + num_seqs * j)
                ends.append(t)
            return ends
        base = self.step_overhead_s + self.per_seq_overhead_s * num_seqs + 0.0
        ctx = decode_ctx_sum + num_seqs * np.arange(k, dtype=np.int64)
        steps = np.empty(k + 1)
        steps[0] = start
        steps[1:] = base + self.decode_per_ctx_token_s * ctx.astype(np.float64)
        return np.add.accumulate(steps)[1:]

    def frontend_delay(self, prompt_len: int) -> float:
        return self.frontend_overhead_s + self.frontend_per_token_s * prompt_len

    def cpu_load_time(self, nbytes: float) -> float:
        return self.cpu_load_overhead_s + nbytes / (self.pcie_gbps * 1e9)

    def transfer_time(self, nbytes: float) -> float:
        """A PD / migration KV transfer over the NIC."""
        return self.transfer_overhead_s + nbytes / (self.nic_gbps * 1e9)

    def remote_load_time(self, nbytes: float) -> float:
        return self.remote_load_overhead_s + nbytes / (self.remote_rate_gbps(nbytes) * 1e9)

    def remote_rate_gbps(self, nbytes: float) -> float:
        table = self.remote_gbps_by_bytes
        if not table:
            return self.remote_gbps
        xs = [p[0] for p in table]
        if nbytes <= xs[0]:
            return table[0][1]
        if nbytes >= xs[-1]:
            return table[-1][1]
        i = bisect.bisect_right(xs, nbytes)
        (x0, y0), (x1, y1) = table[i - 1], table[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


_FIELDS = {f.name for f in fields(Profile)}
_REQUIRED = {"model", "gpu", "kv_bytes_per_token", "gpu_kv_capacity_bytes", "max_model_len"}


def _from_dict(name: str, d: dict[str, Any], where: str) -> Profile:
    unknown = set(d) - _FIELDS - {"name", "notes"}
    if unknown:
        raise ConfigError(f"{where}: profile {name!r} has unknown fields {sorted(unknown)}")
    missing = _REQUIRED - set(d)
    if missing:
        raise ConfigError(f"{where}: profile {name!r} lacks required fields {sorted(missing)}")
    kw = {k: v for k, v in d.items() if k in _FIELDS and k != "name"}
    for k in ("sources", "assumptions"):
        if k in kw:
            kw[k] = tuple(kw[k])
    if "host_contention" in kw:
        kw["host_contention"] = host_contention_of(kw["host_contention"], f"{where}: profile {name!r}")
    if kw.get("host_cpu") is not None:
        kw["host_cpu"] = host_cpu_of(kw["host_cpu"], f"{where}: profile {name!r}")
    if kw.get("stalls") is not None:
        kw["stalls"] = stalls_of(kw["stalls"], f"{where}: profile {name!r}")
    if "remote_gbps_by_bytes" in kw:
        kw["remote_gbps_by_bytes"] = tuple((float(a), float(b)) for a, b in kw["remote_gbps_by_bytes"])
    try:
        p = Profile(name=name, **kw)
    except TypeError as exc:
        raise ConfigError(f"{where}: profile {name!r}: {exc}") from None
    if p.kv_bytes_per_token <= 0 or p.gpu_kv_capacity_bytes <= 0 or p.block_size <= 0:
        raise ConfigError(f"{where}: profile {name!r}: sizes must be positive")
    try:
        check_enough_kv_cache(p.max_model_len, p.num_gpu_blocks(), p.block_size, p.block_bytes())
    except ConfigError as exc:
        raise ConfigError(f"{where}: profile {name!r}: {exc}") from None
    return p


def host_contention_of(table: Any, where: str) -> tuple[float, ...]:
    """``host_contention`` as the profile file writes it, ``{"1": 1.0, "2": 1.6}`` (busy engines ->
    step-time factor; a list in that order is taken too), as the tuple the emulator reads. The counts
    must run from 1 without a gap (the largest is how many engines share a host) and the factors be
    positive, 1.0 for one busy engine: the factors are relative to an engine working alone."""
    if isinstance(table, dict):
        try:
            items = sorted((int(k), float(v)) for k, v in table.items())
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: host_contention must map busy-engine counts to factors, got {table!r}") from None
    elif isinstance(table, (list, tuple)):
        items = [(i + 1, float(v)) for i, v in enumerate(table)]
    else:
        raise ConfigError(f"{where}: host_contention must be an object {{busy engines: factor}}, got {table!r}")
    if not items:
        return ()
    if [k for k, _ in items] != list(range(1, len(items) + 1)):
        raise ConfigError(f"{where}: host_contention's counts must be 1, 2, ... without a gap, got {[k for k, _ in items]}")
    if items[0][1] != 1.0 or any(not 0 < v < float("inf") for _, v in items):
        raise ConfigError(f"{where}: host_contention's factors must be positive and finite, 1.0 for one busy engine, "
                          f"got {[v for _, v in items]}")
    return tuple(v for _, v in items)


def _gib(b: float) -> str:
    return f"{round(b / 2**30, 2)}"  # vLLM's format_gib


def check_enough_kv_cache(max_model_len: int, num_gpu_blocks: int, block_size: int, block_bytes: int) -> None:
    """Refuse a configuration whose KV cache cannot hold one request of ``max_model_len`` tokens.

    vLLM 0.32 refuses to start such an engine (``v1/core/kv_cache_utils.py``
    ``check_enough_kv_cache_memory``): it needs ``ceil(max_model_len / block_size)`` blocks within
    the pool less the null block the block pool holds back, and suggests the largest length that
    fits. Here ``num_gpu_blocks`` counts the null block (as :meth:`Profile.num_gpu_blocks` does), so
    the usable memory is ``(num_gpu_blocks - 1) x block_bytes``. The message is vLLM's.
    """
    available = (num_gpu_blocks - 1) * block_bytes
    if available <= 0:
        raise ConfigError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                          "when initializing the engine.")
    needed = -(-max_model_len // block_size) * block_bytes
    if needed > available:
        est = (num_gpu_blocks - 1) * block_size
        hint = f"Based on the available memory, the estimated maximum model length is {est}. " if est > 0 else ""
        raise ConfigError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), ({_gib(needed)} GiB KV "
            f"cache is needed, which is larger than the available KV cache memory ({_gib(available)} GiB). {hint}"
            "Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
            "decreasing `max_model_len` when initializing the engine.")


def _read(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"profile file {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"profile file {path} is not valid JSON: {exc}") from None
    profiles = data.get("profiles") if isinstance(data, dict) else None
    if not isinstance(profiles, dict):
        raise ConfigError(f"profile file {path} must be an object with a 'profiles' object")
    return profiles


def available_profiles() -> list[str]:
    """Names of the bundled profiles."""
    return sorted(_read(PROFILES_PATH))


def load_profile(name: str | pathlib.Path) -> Profile:
    """A bundled profile by name, or ``path.json[#name]`` of a user file (first profile if no name).

    Unknown names raise :class:`ConfigError` listing what is available.
    """
    if isinstance(name, Profile):
        return name
    s = str(name)
    path_part, _, frag = s.partition("#")
    if path_part.endswith(".json"):
        path = pathlib.Path(path_part)
        profiles = _read(path)
        if not profiles:
            raise ConfigError(f"profile file {path} holds no profiles")
        key = frag or next(iter(profiles))
        if key not in profiles:
            raise ConfigError(f"profile {key!r} not in {path}; it has {sorted(profiles)}")
        return _from_dict(key, profiles[key], str(path))
    profiles = _read(PROFILES_PATH)
    if s not in profiles:
        raise ConfigError(f"unknown engine profile {s!r}; available: {', '.join(sorted(profiles))} "
                          "(or a path to a .json profile file)")
    return _from_dict(s, profiles[s], str(PROFILES_PATH))
