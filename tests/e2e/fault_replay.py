"""A closed-loop replay through a real gateway over real emulated engine processes
(``gpuhit emulate``) while a scripted schedule kills, wedges (SIGSTOP / SIGCONT), slows and
restarts engines and drops their KV-event connections; and the report of what each fault cost.

A slow engine is made from the harness alone, with no knob in the engine: it is SIGSTOPped and
SIGCONTed in a duty cycle (:data:`SLOW_SHARE` of every :data:`SLOW_PERIOD` running), so it is a
real process that keeps answering, only given a tenth of its time. Its gaps between bytes stay
far below the stall window, so the gateway should keep it (the report counts its ejections).
The emulator times its steps on its loop clock, so a stop defers its output to the next running
slice rather than multiplying its work: its requests wait about twice as long, not ten times
(the report gives their mean wait beside that of the requests no fault touched).

Used by ``tests/e2e/test_fault_replay.py`` (CI) and runnable as a script for the numbers:
``python tests/e2e/fault_replay.py`` prints the per-fault report as JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from replayer.arrivals import ArrivalConfig
from replayer.driver import DriverConfig, replay
from replayer.live import HttpTarget
from replayer.records import RequestRecord
from replayer.synth import TokenSynthesizer
from replayer.trace import Session, Trace, Turn

KILL_RESTART = "kill_restart"  # SIGKILL, then the engine again on the same ports after `down` s
WEDGE = "wedge"  # SIGSTOP for `down` s, then SIGCONT (health checks, scrapes, requests all hang)
DROP_KV = "drop_kv"  # the gateway's KV-event connection to the engine cut (the engine keeps running)
KILL = "kill"  # SIGKILL, down for `down` s, then back on the same ports (a slower restart)
SLOW = "slow"  # for `down` s the engine runs SLOW_SHARE of every SLOW_PERIOD (SIGSTOP / SIGCONT duty cycle)
KINDS = (KILL_RESTART, WEDGE, DROP_KV, KILL, SLOW)
SLOW_PERIOD = 0.15  # s; each stop lasts 135 ms, well under a stall window's fifth (when the gateway suspects)
SLOW_SHARE = 0.1


@dataclasses.dataclass(frozen=True)
class Fault:
    at: float  # seconds after the replay starts
    kind: str
    engine: int
    down: float = 0.0


@dataclasses.dataclass
class FaultEvent:
    fault: Fault
    start: float = math.nan  # loop time the fault began
    end: float = math.nan  # loop time it was lifted (the engine back, resumed)
    ejections: int = 0  # times the gateway's breaker of the engine opened while the fault lasted


SCHEDULE = (
    Fault(2.0, KILL_RESTART, 0, 0.0),  # a quick restart: the phantom-hit case
    Fault(5.0, WEDGE, 1, 5.0),  # longer than the test's TTFB budget
    Fault(12.0, DROP_KV, 0),
    Fault(14.0, KILL, 1, 1.5),
    Fault(16.5, SLOW, 0, 3.5),  # the other engine healthy, so an ejection would be possible
)


def free_ports() -> tuple[int, int]:
    """(HTTP port, KV-events port whose next port, the replay socket's, is free too)."""
    for _ in range(50):
        socks = [socket.socket() for _ in range(3)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            kv = socks[0].getsockname()[1]
            socks[1].bind(("127.0.0.1", kv + 1))
            socks[2].bind(("127.0.0.1", 0))
            http = socks[2].getsockname()[1]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return http, kv
    raise AssertionError("no free ports")


class EngineProcess:
    """One ``gpuhit emulate`` child process on fixed ports, so that it can come back on them."""

    def __init__(self, name: str, extra: Sequence[str] = ()):
        self.name = name
        self.http_port, self.kv_port = free_ports()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.extra = list(extra)
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout: float = 60.0) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replayer.cli", "emulate", "--port", str(self.http_port), "--kv-events-port",
            str(self.kv_port), "--model", "m", "--name", self.name, *self.extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=dict(os.environ))
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            rest = await self.proc.stdout.read()
            raise AssertionError(f"engine {self.name} exited: {rest.decode(errors='replace')[-2000:]}")
        # The rest of its output is drained, so a chatty engine never blocks on a full pipe.
        asyncio.get_running_loop().create_task(self._drain(self.proc))

    @staticmethod
    async def _drain(proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while await proc.stdout.read(65536):
            pass

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process dies as soon as it runs again
            self.proc.kill()
            await self.proc.wait()


async def throttle(eng: EngineProcess, duration: float, share: float = SLOW_SHARE,
                   period: float = SLOW_PERIOD) -> None:
    """Give ``eng`` only ``share`` of its time for ``duration`` s: run ``share * period``, stop
    for the rest of each period; it is left running."""
    loop = asyncio.get_running_loop()
    end = loop.time() + duration
    try:
        while loop.time() < end:
            await asyncio.sleep(share * period)
            eng.signal(signal.SIGSTOP)
            await asyncio.sleep(min((1.0 - share) * period, max(end - loop.time(), 0.0)))
            eng.signal(signal.SIGCONT)
    finally:
        if eng.proc is not None and eng.proc.returncode is None:
            eng.signal(signal.SIGCONT)


async def inject(schedule: Sequence[Fault], engines: Sequence[EngineProcess], drop_kv: Callable[[int], None],
                 t0: float, opens: Callable[[int], int] = lambda i: 0) -> list[FaultEvent]:
    """Run ``schedule`` (times relative to the loop time ``t0``); the events with their times and
    the ejections of their engine while they lasted (``opens(i)``: engine i's breaker openings)."""
    loop = asyncio.get_running_loop()
    events = []
    for f in sorted(schedule, key=lambda f: f.at):
        await asyncio.sleep(max(t0 + f.at - loop.time(), 0.0))  # the schedule's own clock
        ev = FaultEvent(f, start=loop.time())
        opened = opens(f.engine)
        eng = engines[f.engine]
        if f.kind in (KILL_RESTART, KILL):
            await eng.kill()
            if f.down:
                await asyncio.sleep(f.down)
            await eng.start()
        elif f.kind == WEDGE:
            eng.signal(signal.SIGSTOP)
            await asyncio.sleep(f.down)
            eng.signal(signal.SIGCONT)
        elif f.kind == SLOW:
            await throttle(eng, f.down)
        elif f.kind == DROP_KV:
            drop_kv(f.engine)
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}; expected one of {KINDS}")
        ev.end = loop.time()
        ev.ejections = opens(f.engine) - opened
        events.append(ev)
    return events


def trace(n_sessions: int = 200, turns: int = 8, blocks_per_turn: int = 8, output: int = 24) -> Trace:
    """Sessions whose every turn extends the previous one's prompt (prefix hits to predict)."""
    sessions = []
    for s in range(n_sessions):
        ids: list[int] = []
        ts = []
        for k in range(turns):
            ids = ids + [1000 * s + 10 * k + j for j in range(blocks_per_turn)]
            ts.append(Turn(input_length=len(ids) * 16, output_length=output, hash_ids=tuple(ids)))
        sessions.append(Session(f"s{s}", tuple(ts), block_size=16, namespace=f"s{s}"))
    return Trace("faults", "native", tuple(sessions))


def report(records: Sequence[RequestRecord], events: Sequence[FaultEvent], names: Sequence[str],
           after: float = 1.0) -> list[dict[str, Any]]:
    """Per fault: the requests it affected (those on its engine while it lasted or within ``after``
    s of its end), how many failed, the worst wait among them (send to end), and the phantom hits
    of its engine after it began (predicted > realized, requests that succeeded); its engine's
    ejections while it lasted; and the mean wait of its requests beside that of the requests no
    fault touched (how much slower they were)."""
    touched: set[int] = set()
    for ev in events:
        touched.update(id(r) for r in records if r.arrival <= ev.end + after and r.finish >= ev.start)
    calm = [r.finish - r.arrival for r in records if r.ok and id(r) not in touched]
    calm_mean = sum(calm) / len(calm) if calm else math.nan
    out = []
    for ev in events:
        f = ev.fault
        name = names[f.engine]
        lo, hi = ev.start, ev.end + after
        hit = [r for r in records if r.arrival <= hi and r.finish >= lo and r.instance == name]
        phantom = [r for r in records if r.ok and r.instance == name and r.arrival >= ev.start
                   and r.predicted_hit_tokens > r.realized_hit_tokens]
        out.append({"fault": f.kind, "engine": name, "at_s": round(f.at, 2), "down_s": round(ev.end - ev.start, 2),
                    "requests_affected": len(hit), "failed": sum(1 for r in hit if r.error),
                    "worst_wait_s": round(max((r.finish - r.arrival for r in hit), default=0.0), 3),
                    "mean_wait_s": round(sum(r.finish - r.arrival for r in hit) / len(hit), 3) if hit else 0.0,
                    "calm_mean_wait_s": round(calm_mean, 3), "ejections": ev.ejections,
                    "phantom_hits": len(phantom),
                    "errors": sorted({r.error.split(" (")[0][:90] for r in hit if r.error})})
    return out


#: ok requests sent after the last fault was lifted before the replay stops (the test asks for 10)
AFTER_LAST_FAULT = 12


async def run(gateway: Callable[..., Any], gateway_kw: dict[str, Any], schedule: Sequence[Fault] = SCHEDULE,
              after: int = AFTER_LAST_FAULT, concurrency: int = 6, engine_args: Sequence[str] = ()) -> dict[str, Any]:
    """Engines up, a gateway over them (``gateway(urls, **gateway_kw)``: an async context manager
    giving ``(gateway, url)``), the replay and the schedule at once; the records, events, report.

    The replay ends on a condition, not after a fixed time: once the whole schedule has run and
    ``after`` requests sent after its last fault was lifted have succeeded (or the trace is spent).
    How long the schedule takes is not known in advance: a restarted engine is a new process,
    whose start takes seconds on a loaded machine, and every later fault waits for it."""
    engines = [EngineProcess(f"e{i}", engine_args) for i in range(2)]
    try:
        await asyncio.gather(*(e.start() for e in engines))
        async with gateway([e.url for e in engines], **gateway_kw) as (gw, url), aiohttp.ClientSession() as http:

            def drop_kv(i: int) -> None:
                for sub in gw.engines[i].subscribers:
                    assert sub._conn is not None
                    sub._conn.drop()

            target = HttpTarget(url, TokenSynthesizer(seed=7), http)
            cfg = DriverConfig(arrival=ArrivalConfig(mode="concurrent", sessions_concurrent=concurrency, time_scale=0.0))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            stop = asyncio.Event()
            schedule_end = math.inf  # loop time the last fault was lifted
            ok_after = 0

            def on_record(r: RequestRecord) -> None:
                nonlocal ok_after
                if r.ok and r.arrival > schedule_end:
                    ok_after += 1
                    if ok_after >= after:
                        stop.set()

            async def faults() -> list[FaultEvent]:
                nonlocal schedule_end
                events = await inject(schedule, engines, drop_kv, t0, lambda i: gw.breakers[i].opens)
                schedule_end = max(e.end for e in events)
                return events

            faults_task = asyncio.create_task(faults())
            try:
                out = await replay(trace(), target, cfg, on_record=on_record, stop=stop)
            finally:
                events = await faults_task
            names = list(gw.names) if hasattr(gw, "names") else [f"e{i}" for i in range(len(engines))]
            return {"records": out.records, "events": events, "report": report(out.records, events, names),
                    "wall_s": loop.time() - t0}
    finally:
        for e in engines:
            await e.kill()


def main() -> None:
    from tests.e2e.helpers import gateway

    kw = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    res = asyncio.run(run(gateway, {"policy": "lpwl", "health_interval": 0.2, **kw}))
    recs = res["records"]
    summary = {"requests": len(recs), "failed": sum(1 for r in recs if r.error),
               "worst_wait_s": round(max(r.finish - r.arrival for r in recs), 3),
               "phantom_hits": sum(1 for r in recs if r.ok and r.predicted_hit_tokens > r.realized_hit_tokens),
               "wall_s": round(res["wall_s"], 1)}
    print(json.dumps({"summary": summary, "faults": res["report"]}, indent=1))


if __name__ == "__main__":
    main()
