"""Simulated replay: the gateway core and N emulated vLLM instances on a virtual-time event loop.

:func:`simulate` builds, for one (trace, policy, seed): N engines (emulated by default), a
:class:`~gateway.router.Router` with a KV index, a :class:`~replayer.sim_target.SimTarget` that
turns each trace turn into a routed request (token-synthesized block hashes, never token lists: the
emulator trusts the hashes), and the closed-loop :mod:`replayer.driver`; then runs it all on :func:`gpuhit.vtime.run`, where the
clock jumps to the next event, so hours of agent traffic replay in seconds of wall time. The code
path is the live one: only the loop and the engines differ.

Utilization: a sampler task reads every engine's cumulative busy time each ``util_interval``
seconds of simulated time and turns the deltas into a per-engine busy-fraction series (for the
"GPU utilization over time" plot); the per-engine totals at the end give the summary's utilization.

Trace span (for wall-clock amplification): the time the recorded trace itself would take under the
same session start schedule and think-time transform (scale, cap): the latest ``session start +
recorded service times + transformed think times`` over all sessions
(:func:`replayer.arrivals.replay_offset` of the last turn; WEKA
records no duration for a last turn, so its service time is not counted). Amplification > 1 means
the simulated cluster served the turns slower than the recorded service did. It is NaN in
``concurrent`` mode, whose start schedule depends on the replay itself.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.emulated.profile import DEFAULT_PROFILE
from gpuhit import vtime
from gpuhit.errors import ConfigError
from replayer.arrivals import (
    ArrivalConfig,
    child_offset,
    children_index,
    replay_offset,
    root_start_times,
    roots,
)
from replayer.driver import DriverConfig, ReplayOutcome, count_requests, replay
from replayer.records import RequestRecord, records_to_frame
from replayer.sim_engines import EngineFactory, busy_time, emulated_factory, engine_series, new_registry
from replayer.sim_target import SimTarget
from replayer.trace import Trace


@dataclass(slots=True)
class RunResult:
    """Everything one simulated run produced. Times are simulated seconds unless named ``wall``."""

    policy: str
    seed: int
    records: list[RequestRecord]
    engine_names: tuple[str, ...]
    busy_time: dict[str, float]  # per engine, seconds busy during the run (None-free; NaN if unknown)
    util_series: dict[str, tuple[list[float], list[float]]]  # per engine: (bin starts, busy fraction)
    makespan: float
    trace_span: float
    wall_s: float
    requests_total: int
    router_stats: dict[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ()

    @property
    def sim_wall_ratio(self) -> float:
        return self.makespan / self.wall_s if self.wall_s > 0 else math.inf

    def frame(self):
        return records_to_frame(self.records)

    def summary(self) -> dict[str, Any]:
        """:func:`analysis.summary.summarize` of this run, plus identity and timing fields."""
        from analysis.summary import summarize

        s = summarize(self.frame(), self.busy_time, self.makespan, self.trace_span)
        s.update(policy=self.policy, seed=self.seed, wall_s=self.wall_s, sim_wall_ratio=self.sim_wall_ratio,
                 router=self.router_stats, roles=list(self.roles))
        return s


def trace_span(trace: Trace, cfg: ArrivalConfig, max_sessions: int | None = None, *,
               think_time_scale: float | None = None, max_think_time: float | None = None) -> float:
    """Latest ``session start + replayed span of its recorded timeline`` (see module docstring)."""
    rs = roots(trace)
    if max_sessions:
        rs = rs[:max_sessions]
    starts = root_start_times(rs, cfg)
    if starts is None:
        return math.nan
    kids = children_index(trace)
    span = 0.0
    stack = list(zip(rs, starts))
    while stack:
        s, t = stack.pop()
        if s.turns:
            span = max(span, t + replay_offset(s, s.turns[-1].offset, cfg.time_scale, think_time_scale,
                                                max_think_time))
        stack.extend((c, t + child_offset(c, s, cfg.time_scale, think_time_scale, max_think_time))
                     for c in kids.get(s.session_id, ()))
    return span


def _pd_roles(spec: str, instances: int) -> tuple[str, ...]:
    """'6P+2D' -> ('prefill',)*6 + ('decode',)*2, checked against the instance count."""
    import re

    m = re.fullmatch(r"\s*(\d+)\s*[Pp]\s*\+\s*(\d+)\s*[Dd]\s*", spec)
    if not m:
        raise ConfigError(f"bad PD split {spec!r}; write it like 6P+2D")
    p, d = int(m.group(1)), int(m.group(2))
    if p <= 0 or d <= 0:
        raise ConfigError(f"PD split {spec!r} needs at least one prefill and one decode instance")
    if instances and p + d != instances:
        raise ConfigError(f"PD split {spec!r} has {p + d} instances but --instances is {instances}")
    return ("prefill",) * p + ("decode",) * d


def simulate(
    trace: Trace,
    policy: str | Mapping[str, Any] | Any,
    *,
    instances: int = 8,
    profile: str = DEFAULT_PROFILE,
    arrival: str = "trace",
    session_rate: float | None = None,
    sessions_concurrent: int | None = None,
    time_scale: float = 1.0,
    think_time_scale: float | None = None,
    max_think_time: float | None = None,
    open_loop: bool = False,
    seed: int = 0,
    roles: Sequence[str] | None = None,
    index: str = "precise",
    engine_kwargs: Mapping[str, Any] | None = None,
    engine_factory: EngineFactory | None = None,
    max_sessions: int | None = None,
    max_requests: int | None = None,
    duration: float | None = None,
    progress: bool | Callable[[int, int, float], None] = True,
    sink: Callable[[RequestRecord], None] | None = None,
    skip: Sequence[tuple[str, int]] | frozenset = frozenset(),
    util_interval: float | None = None,
    block_size: int = 16,
    label: str | None = None,
    synth: Any = None,
    replicas: Any = None,
    live_path: Callable[[int], float] | None = None,
    engine_timing: bool = False,
) -> RunResult:
    """Replay ``trace`` on ``instances`` simulated engines under ``policy`` in virtual time.

    ``policy``: a registered type name, a ``{name, type, params}`` mapping, or a built policy.
    ``roles``: one of "both"/"prefill"/"decode" per instance (PD configs: with pd_disagg).
    ``index``: "precise" (KV events) or "approximate" (routing history).
    ``engine_factory(name, i, registry)``: build engines other than the emulator (tests: FakeEngine).
    ``progress``: True = a stderr progress line (TTY only), False = none, or a callable
    ``(done, total, sim_time)`` called per finished request.
    ``util_interval``: simulated seconds per utilization bin (default: makespan estimate / 300,
    at least 1 s, fixed up front from the trace span).
    ``synth``: a :class:`~replayer.synth.TokenSynthesizer` for ``seed`` and ``block_size`` to reuse
    (its memoized block hashes are pure functions of the trace, seed and block size, so runs of
    several policies share them; default: a new one with the chain identity, which gives the records
    that vLLM's exact hashes give, faster).
    ``replicas``: a :class:`~replayer.replicas.ReplicaConfig` to route through K gateway replicas
    (None or one replica: the single router).
    ``live_path``: seconds a request spends on the live path before the gateway routes it, given the
    requests in flight there (:class:`~replayer.live_path.LivePathModel`; None: no such path).
    ``engine_timing``: records carry the engine's own timing of each request (queue, prefill, decode,
    engine TTFT and e2e: :class:`~replayer.records.EngineTimedRecord`), as live runs do from vLLM's spans.
    """
    from gateway.kv_index import ApproximateKVIndex, PreciseKVIndex
    from gateway.kv_index_chain import ChainIdKVIndex
    from gateway.router import Router
    from policies.registry import build
    from replayer.synth import TokenSynthesizer

    if instances <= 0:
        raise ConfigError(f"instances must be positive, got {instances}")
    if index not in ("precise", "approximate"):
        raise ConfigError(f"unknown KV index {index!r}; choose precise or approximate")
    pol = build(policy) if isinstance(policy, (str, Mapping)) else policy
    pol_name = label or str(getattr(pol, "name", policy))
    acfg = ArrivalConfig(mode=arrival, session_rate=session_rate, sessions_concurrent=sessions_concurrent,
                         time_scale=time_scale, seed=seed)
    dcfg = DriverConfig(arrival=acfg, open_loop=open_loop, think_time_scale=think_time_scale,
                        max_think_time=max_think_time, max_sessions=max_sessions, max_requests=max_requests, duration=duration,
                        run_id=f"{pol_name}-s{seed}", policy=pol_name, seed=seed)
    if roles is not None and len(roles) != instances:
        raise ConfigError(f"{len(roles)} roles given for {instances} instances")
    if open_loop:
        span = trace_span(trace, acfg, max_sessions)  # open loop: recorded offsets, no transform
    else:
        span = trace_span(trace, acfg, max_sessions, think_time_scale=think_time_scale,
                          max_think_time=max_think_time)
    total = count_requests(trace, max_sessions)
    if max_requests is not None:
        total = min(total, max_requests)
    if util_interval is None:
        util_interval = max(1.0, (span if not math.isnan(span) and span > 0 else 3600.0) / 300.0)

    sched = getattr(pol, "scheduling_policy", None)  # a policy that sets vLLM priorities needs it
    if sched is not None and engine_factory is None:
        given = (engine_kwargs or {}).get("scheduling_policy", sched)
        if given != sched:
            raise ConfigError(f"policy {pol_name!r} needs scheduling_policy {sched!r}, engines given {given!r}")
        engine_kwargs = {**(engine_kwargs or {}), "scheduling_policy": sched}
    if synth is None:
        # in virtual time the block hashes reach only these engines and this router: the cheap
        # chain identity gives them the same equalities as vLLM's hashes (replayer.synth)
        synth = TokenSynthesizer(seed=seed, engine_block_size=block_size, identity="chain")
    elif synth.seed != seed or synth.engine_block_size != block_size:
        raise ConfigError(f"the synthesizer given is for seed {synth.seed}, block size {synth.engine_block_size}; "
                          f"this run has seed {seed}, block size {block_size}")
    factory = engine_factory or emulated_factory(profile, engine_kwargs, util_interval,
                                                 block_ids=getattr(synth, "identity", "vllm"), seed=seed)

    async def main() -> tuple[ReplayOutcome, dict[str, float], dict[str, tuple[list[float], list[float]]], Any]:
        registry = new_registry() if engine_factory is None else None
        engines = [factory(f"gpu{i}", i, registry) for i in range(instances)]
        def make_index(engs: Sequence[Any]) -> Any:
            if index != "precise":
                return ApproximateKVIndex.from_engines(engs)
            if getattr(synth, "identity", None) == "chain":
                return ChainIdKVIndex(instances)  # the same answers, as arrays (gateway/kv_index_chain.py)
            return PreciseKVIndex(instances)

        router: Any
        if replicas is not None and replicas.replicas > 1:
            from replayer.replicas import build_replicas

            router = build_replicas(replicas, engines, lambda: build(policy) if isinstance(policy, (str, Mapping)) else pol,
                                    make_index, index == "precise", seed, block_size=block_size, roles=roles)
        else:
            router = Router(engines, pol, index=make_index(engines), block_size=block_size, roles=roles)
        target = SimTarget(router, synth, live_path=live_path, engine_timing=engine_timing)
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        busy0 = [busy_time(e) for e in engines]
        series: dict[str, tuple[list[float], list[float]]] = {e.name: ([], []) for e in engines}
        stop = asyncio.Event()

        async def sampler() -> None:
            prev = list(busy0)
            t_prev = t0
            while not stop.is_set():
                await asyncio.sleep(util_interval)
                now = loop.time()
                for i, e in enumerate(engines):
                    b = busy_time(e)
                    if own[i] or b is None or prev[i] is None:
                        continue
                    ts, us = series[e.name]
                    ts.append(t_prev - t0)
                    us.append(min(1.0, max(0.0, (b - prev[i]) / (now - t_prev))))
                    prev[i] = b
                t_prev = now

        done = 0
        prog_cb: Callable[[int, int, float], None] | None
        bar = None
        if callable(progress):
            prog_cb = progress
        elif progress:
            from replayer.progress import Progress

            bar = Progress(total, label=pol_name)
            prog_cb = lambda d, tot, sim: bar.update(d, sim)
        else:
            prog_cb = None

        def on_record(_: RequestRecord) -> None:
            nonlocal done
            done += 1
            if prog_cb is not None:
                prog_cb(done, total, loop.time() - t0)

        own = [getattr(getattr(e, "metrics", None), "utilization_series", None) is not None for e in engines]
        need_sampler = any(b is not None and not o for b, o in zip(busy0, own))
        sampler_task = asyncio.ensure_future(sampler()) if need_sampler else None
        try:
            out = await replay(trace, target, dcfg, sink=sink, skip=frozenset(skip), on_record=on_record)
        finally:
            stop.set()
            if sampler_task is not None:
                sampler_task.cancel()
                try:
                    await sampler_task
                except asyncio.CancelledError:
                    pass
            if bar is not None:
                bar.close()
        busy = {}
        now = loop.time()
        for i, e in enumerate(engines):
            b = busy_time(e)
            busy[e.name] = (b - busy0[i]) if (b is not None and busy0[i] is not None) else math.nan
            if own[i]:
                got = engine_series(e, now, t0)
                if got is not None:
                    series[e.name] = got
            close = getattr(e, "close", None)
            if close is not None:
                res = close()
                if inspect.isawaitable(res):
                    await res
        st = router.stats.as_dict() if hasattr(router.stats, "as_dict") else dict(vars(router.stats))
        return out, busy, series, st

    wall0 = time.perf_counter()
    out, busy, series, rstats = vtime.run(main())
    wall = time.perf_counter() - wall0
    busy_known = {k: v for k, v in busy.items() if not math.isnan(v)}
    return RunResult(
        policy=pol_name,
        seed=seed,
        records=out.records,
        engine_names=tuple(busy),
        busy_time=busy_known,
        util_series=series,
        makespan=out.makespan,
        trace_span=span,
        wall_s=wall,
        requests_total=total,
        router_stats=rstats,
        roles=tuple(roles) if roles is not None else (),
    )
