"""Latency cost model for moving KV versus moving work (pure Python: no torch, no I/O, no clock).

Two layers, both closed-form so a policy can evaluate them per request in microseconds:

1. **The cross-instance attention primitives of *Move the Query, Not the Cache*** (README "References"),
   for one remote chunk of ``ct`` tokens attended by ``Mq`` query rows::

       T_route = T_probe(F) + Mq * (q + p) / BW(F) + T_compute + T_merge
       T_fetch = T_splice + ct * b_KV / BW(F)            (T_splice ~ 3 ms flat on MLA)
       T_local = ct * L * c                              (c = 0.5 .. 1.5 us per token x layer)

   with the per-fabric constants (T_probe, BW) of :data:`FABRICS` and the MLA row sizes
   q = 1152 B, p = 1032 B (DeepSeek-V2-Lite: 27 layers, d_qk 576, d_v 512). :func:`choose_primitive`
   is the predicate: the cheapest of the three (ties resolved route < fetch < local, i.e. the
   primitive that moves fewer bytes wins a tie).

2. **Serving-level costs** (what the ``route_query`` routing policy needs): the time until a
   request's first token if it (a) stays on the instance holding its prefix in GPU memory,
   (b) fetches that prefix's KV to a lighter instance first, or (c) recomputes it there. Built from

   * the prefill profile ``T_prefill(n new tokens after c cached) = a*n + b*((c+n)^2 - c^2)``
     (a = 50e-6 s, b = 2.94e-9 s fit the miss column of the *GPU-Hit-First* note's hit-tier table
     within 1%; the quadratic
     term is attention of the new tokens over the whole context),
   * a queue estimate ``pending_prefill_tokens * per_token_s`` (work already routed to the instance
     and not yet prefilled, as the gateway counts it),
   * a KV transfer ``T_probe + tokens * kv_bytes_per_token / BW`` over a fabric (default KV size
     98304 B/token = 96 KiB, Qwen3-Coder-30B-A3B; default fabric the NIC at 9.7 GB/s that the
     *GPU-Hit-First* note measured for PD transfers).

All times are seconds, all sizes bytes, bandwidths GB/s (1e9 bytes/s). Everything here is a frozen
dataclass or a pure function so engines/attention and the policies share one copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuhit.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# Constants from the papers (README "References")
# --------------------------------------------------------------------------------------------------

#: MLA routed query row and returned partial row, bytes (*Move the Query, Not the Cache*: q + p = 2184 B).
MLA_Q_BYTES = 1152
MLA_P_BYTES = 1032
#: DeepSeek-V2-Lite shape used by the measurements of *Move the Query, Not the Cache*.
DSV2_LITE_LAYERS = 27
MLA_D_QK = 576
MLA_D_V = 512
#: Per-token all-layer MLA latent cache size in bf16: 27 layers x 576 dims x 2 bytes = 31104 B
#: (a 2048-token chunk is that paper's "64 MB all-27-layer chunk").
MLA_KV_BYTES_PER_TOKEN = DSV2_LITE_LAYERS * MLA_D_QK * 2
#: Fetch's position-adaptation splice, flat in chunk size (measured 2.77-3.06 ms for 55..4096 tokens).
FETCH_SPLICE_S = 3.0e-3
#: Re-prefill cost per token x layer band of *Move the Query, Not the Cache* (``local``), seconds.
LOCAL_C_LOW_S = 0.5e-6
LOCAL_C_HIGH_S = 1.5e-6
LOCAL_C_MID_S = 1.0e-6

#: KV bytes per token of the *GPU-Hit-First* note's serving model (48 layers x 4 KV heads x 128 dims x 2 (K,V) x 2 B).
DEFAULT_KV_BYTES_PER_TOKEN = 98304
#: Prefill profile fit to the *GPU-Hit-First* note's miss column (full prefill of L tokens
#: ~ 50 us x L + 2.94e-9 s x L^2).
DEFAULT_PREFILL_A = 50e-6
DEFAULT_PREFILL_B = 2.94e-9


@dataclass(frozen=True, slots=True)
class Fabric:
    """A link between two instances: fixed per-transfer latency and effective bandwidth."""

    name: str
    probe_us: float  # one-way put+signal latency (the paper's T_probe), microseconds
    bw_gbps: float  # effective bandwidth, GB/s (1e9 B/s)

    def __post_init__(self) -> None:
        if self.probe_us < 0 or self.bw_gbps <= 0:
            raise ConfigError(f"fabric {self.name!r}: probe_us must be >= 0 and bw_gbps > 0")

    @property
    def probe_s(self) -> float:
        return self.probe_us * 1e-6

    def transfer_s(self, nbytes: float) -> float:
        """Time to move ``nbytes`` in one coalesced transfer: probe + bytes / bandwidth."""
        if nbytes <= 0:
            return 0.0
        return self.probe_s + nbytes / (self.bw_gbps * 1e9)


#: The fabric constants *Move the Query, Not the Cache* measured (T_probe us, single-block effective
#: BW GB/s), plus the NIC the *GPU-Hit-First* note measured for PD KV transfers (~9.7 GB/s; its probe is not reported, 16 us - the IBGDA
#: value - is assumed).
FABRICS: Mapping[str, Fabric] = {
    "h100_ibgda": Fabric("h100_ibgda", 16.0, 25.0),
    "h100_nvlink4": Fabric("h100_nvlink4", 1.2, 21.0),
    "a100_nvlink3": Fabric("a100_nvlink3", 1.6, 18.0),
    "pcie_gen5": Fabric("pcie_gen5", 4.8, 22.0),
    "pcie_gen4": Fabric("pcie_gen4", 8.7, 19.0),
    "nic": Fabric("nic", 16.0, 9.7),
}


def get_fabric(name: str, *, bw_gbps: float | None = None, probe_us: float | None = None) -> Fabric:
    """Look up a fabric by name, optionally overriding its bandwidth / probe (e.g. a measured NIC)."""
    try:
        fab = FABRICS[name]
    except KeyError:
        raise ConfigError(f"unknown fabric {name!r}; available: {', '.join(sorted(FABRICS))}") from None
    if bw_gbps is None and probe_us is None:
        return fab
    return Fabric(
        fab.name,
        fab.probe_us if probe_us is None else float(probe_us),
        fab.bw_gbps if bw_gbps is None else float(bw_gbps),
    )


# --------------------------------------------------------------------------------------------------
# Route / fetch / local for one chunk (*Move the Query, Not the Cache*)
# --------------------------------------------------------------------------------------------------


def t_route(
    fabric: Fabric,
    mq: int,
    *,
    q_bytes: int = MLA_Q_BYTES,
    p_bytes: int = MLA_P_BYTES,
    t_compute_s: float = 0.0,
    t_merge_s: float = 0.0,
) -> float:
    """``T_probe + Mq (q + p) / BW + T_compute + T_merge``.

    ``t_compute_s`` / ``t_merge_s`` default to 0, i.e. the transport round trip the paper fits
    (116 us measured at Mq = 1024 on IBGDA; the model gives 105 us, the gap being a ~9 us kernel
    turnaround). The paper bounds them at 15-37 us and <= 25 us at decode; pass measured values.
    """
    if mq < 0:
        raise ConfigError("mq must be >= 0")
    return fabric.probe_s + mq * (q_bytes + p_bytes) / (fabric.bw_gbps * 1e9) + t_compute_s + t_merge_s


def t_fetch(
    fabric: Fabric,
    ct: int,
    *,
    kv_bytes_per_token: int = MLA_KV_BYTES_PER_TOKEN,
    splice_s: float = FETCH_SPLICE_S,
) -> float:
    """``T_splice + ct * b_KV / BW``: pull the whole chunk (one coalesced transfer) and splice it."""
    if ct < 0:
        raise ConfigError("ct must be >= 0")
    return splice_s + ct * kv_bytes_per_token / (fabric.bw_gbps * 1e9)


def t_local(ct: int, *, layers: int = DSV2_LITE_LAYERS, c_s: float = LOCAL_C_MID_S) -> float:
    """``ct * L * c``: recompute the chunk's KV locally (c per token x layer, 0.5-1.5 us)."""
    if ct < 0:
        raise ConfigError("ct must be >= 0")
    return ct * layers * c_s


@dataclass(frozen=True, slots=True)
class PrimitiveChoice:
    """The predicate's verdict and the three costs it compared (seconds)."""

    primitive: str  # "route" | "fetch" | "local"
    route_s: float
    fetch_s: float
    local_s: float


def choose_primitive(
    fabric: Fabric,
    *,
    mq: int,
    ct: int,
    q_bytes: int = MLA_Q_BYTES,
    p_bytes: int = MLA_P_BYTES,
    kv_bytes_per_token: int = MLA_KV_BYTES_PER_TOKEN,
    splice_s: float = FETCH_SPLICE_S,
    layers: int = DSV2_LITE_LAYERS,
    local_c_s: float = LOCAL_C_MID_S,
    t_compute_s: float = 0.0,
    t_merge_s: float = 0.0,
) -> PrimitiveChoice:
    """The closed-form route/fetch/local predicate of *Move the Query, Not the Cache*: the cheapest primitive for one chunk.

    Ties go to the primitive listed first in (route, fetch, local): the one moving fewer bytes.
    """
    r = t_route(fabric, mq, q_bytes=q_bytes, p_bytes=p_bytes, t_compute_s=t_compute_s, t_merge_s=t_merge_s)
    f = t_fetch(fabric, ct, kv_bytes_per_token=kv_bytes_per_token, splice_s=splice_s)
    loc = t_local(ct, layers=layers, c_s=local_c_s)
    best = min((r, 0, "route"), (f, 1, "fetch"), (loc, 2, "local"))
    return PrimitiveChoice(best[2], r, f, loc)


def fetch_local_crossover_tokens(
    fabric: Fabric,
    *,
    kv_bytes_per_token: int = MLA_KV_BYTES_PER_TOKEN,
    splice_s: float = FETCH_SPLICE_S,
    layers: int = DSV2_LITE_LAYERS,
    local_c_s: float = LOCAL_C_MID_S,
) -> float:
    """Chunk size above which fetch beats local (``splice / (L c - b_KV / BW)``); inf if never."""
    slope = layers * local_c_s - kv_bytes_per_token / (fabric.bw_gbps * 1e9)
    return float("inf") if slope <= 0 else splice_s / slope


# --------------------------------------------------------------------------------------------------
# Serving level: prefill profile, queue estimate, KV transfer, stay / fetch / recompute
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillProfile:
    """``T(n new tokens after c cached) = a*n + b*((c+n)^2 - c^2)`` seconds (c = 0: a*n + b*n^2)."""

    a: float = DEFAULT_PREFILL_A
    b: float = DEFAULT_PREFILL_B

    def __post_init__(self) -> None:
        if self.a < 0 or self.b < 0:
            raise ConfigError("prefill profile coefficients a, b must be >= 0")

    def time(self, new_tokens: int, cached_tokens: int = 0) -> float:
        n = max(new_tokens, 0)
        c = max(cached_tokens, 0)
        return self.a * n + self.b * ((c + n) * (c + n) - c * c)

    def marginal_s(self, context_tokens: int) -> float:
        """Cost of one more token at ``context_tokens`` of context (derivative: a + 2 b c)."""
        return self.a + 2.0 * self.b * max(context_tokens, 0)


def prefill_work_tokens(new_tokens: int, cached_tokens: int = 0, profile: PrefillProfile | None = None) -> int:
    """A prefill's time in linear-token equivalents: ``T(n, c) / a`` of :class:`PrefillProfile`,
    i.e. ``n + (b / a) * ((c + n)^2 - c^2)`` rounded (with the default profile each new token costs
    one more token per ~8,500 tokens of context it attends to).

    Why a count of tokens undercounts time: the attention term makes a 50k-token cold prompt take
    ~3.9x what 50k tokens cost linearly (``T = 2.5 s + 7.4 s``), while 50 prompts of 1k take ~1.06x.
    Queued prefill summed in plain tokens therefore prices a queue holding one long prompt at a
    fraction of its wait; summed in this unit (the gateway's ``pending_prefill_work``) it is
    proportional to the queue's time on any instance.
    """
    p = profile or DEFAULT_PROFILE
    n = max(new_tokens, 0)
    return round(p.time(n, cached_tokens) / p.a) if p.a > 0 else n


#: the prefill profile the policies price work with (the *GPU-Hit-First* note's fit)
DEFAULT_PROFILE = PrefillProfile()


def queue_delay_s(pending_prefill_tokens: int, per_token_s: float) -> float:
    """Queue estimate: prefill work already routed to an instance, times a per-token prefill time.

    A linear estimate on purpose: the gateway knows the pending token count exactly but not how it
    splits over requests' contexts, so the quadratic attention term is folded into ``per_token_s``.
    """
    return max(pending_prefill_tokens, 0) * per_token_s


def kv_transfer_s(tokens: int, fabric: Fabric, kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN) -> float:
    """Moving ``tokens`` tokens of KV in one transfer: probe + tokens * bytes/token / BW."""
    return fabric.transfer_s(max(tokens, 0) * kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class OptionCost:
    """Predicted time to first token of one routing option (seconds), and its parts."""

    kind: str  # "stay" | "fetch" | "recompute"
    target: int
    source: int | None
    queue_s: float
    transfer_s: float
    prefill_s: float

    @property
    def total_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class ServingCostModel:
    """Stay / fetch / recompute time-to-first-token predictions for one request.

    ``per_token_queue_s`` prices pending prefill tokens already queued on an instance (default: the
    profile's linear coefficient ``a``; pass the marginal cost at a typical context to include the
    attention term). ``producer_wait`` is the fraction of the *holder's* queue a fetch waits for
    before its KV can be read: with vLLM's KV-connector protocol the holder must first serve a
    producer request (FCFS behind its pending prefills), so 1.0 is the honest default there; 0.0
    models a one-sided pull from registered memory or a KV store that bypasses the holder's
    scheduler. ``splice_s`` is a fixed cost per fetch (0 for a same-position prefix pull on GQA
    models; ~3 ms for MLA re-rotation, per *Move the Query, Not the Cache*).
    """

    profile: PrefillProfile = PrefillProfile()
    fabric: Fabric = FABRICS["nic"]
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    per_token_queue_s: float | None = None
    producer_wait: float = 1.0
    splice_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ConfigError("kv_bytes_per_token must be > 0")
        if not 0.0 <= self.producer_wait <= 1.0:
            raise ConfigError("producer_wait must be within [0, 1]")
        if self.per_token_queue_s is not None and self.per_token_queue_s < 0:
            raise ConfigError("per_token_queue_s must be >= 0")
        if self.splice_s < 0:
            raise ConfigError("splice_s must be >= 0")

    @property
    def queue_per_token_s(self) -> float:
        return self.profile.a if self.per_token_queue_s is None else self.per_token_queue_s

    def queue_s(self, pending_prefill_tokens: int) -> float:
        return queue_delay_s(pending_prefill_tokens, self.queue_per_token_s)

    def stay(self, *, target: int, pending_prefill_tokens: int, input_tokens: int, hit_tokens: int) -> OptionCost:
        """Run on ``target`` using its own GPU prefix hit (also "recompute" when it holds nothing)."""
        hit = min(max(hit_tokens, 0), max(input_tokens - 1, 0))
        return OptionCost(
            "stay",
            target,
            None,
            self.queue_s(pending_prefill_tokens),
            0.0,
            self.profile.time(input_tokens - hit, hit),
        )

    def recompute(self, *, target: int, pending_prefill_tokens: int, input_tokens: int, hit_tokens: int) -> OptionCost:
        """Run on ``target``, recomputing whatever it does not hold itself."""
        c = self.stay(
            target=target, pending_prefill_tokens=pending_prefill_tokens, input_tokens=input_tokens,
            hit_tokens=hit_tokens,
        )
        return OptionCost("recompute", c.target, None, c.queue_s, 0.0, c.prefill_s)

    def fetch(
        self,
        *,
        source: int,
        target: int,
        source_pending_prefill_tokens: int,
        target_pending_prefill_tokens: int,
        input_tokens: int,
        source_hit_tokens: int,
        target_hit_tokens: int,
    ) -> OptionCost:
        """Pull the source's prefix KV (beyond what the target holds) to the target, then prefill the rest.

        The pull overlaps with the target's own queue: the request is ready when both the KV has
        arrived (after ``producer_wait`` x the source's queue, plus the transfer) and the target's
        queue has drained, so the wait is ``max(source wait + transfer, target queue)``; it is
        reported as queue_s = that max minus the transfer, transfer_s = the transfer.
        """
        cap = max(input_tokens - 1, 0)
        src_hit = min(max(source_hit_tokens, 0), cap)
        tgt_hit = min(max(target_hit_tokens, 0), cap)
        hit = max(src_hit, tgt_hit)
        moved = max(src_hit - tgt_hit, 0)
        xfer = (kv_transfer_s(moved, self.fabric, self.kv_bytes_per_token) + self.splice_s) if moved else 0.0
        src_wait = self.producer_wait * self.queue_s(source_pending_prefill_tokens)
        tgt_wait = self.queue_s(target_pending_prefill_tokens)
        ready = max(src_wait + xfer, tgt_wait)
        return OptionCost("fetch", target, source, ready - xfer, xfer, self.profile.time(input_tokens - hit, hit))
