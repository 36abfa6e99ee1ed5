"""Benchmark: `gpuhit serve` against vllm-router (PyPI ``vllm-router``, Rust) in ONE run.

Both routers, and a direct-to-engine baseline, in front of the SAME two zero-latency mock engines
(``tests/perf/mock_engine.py``, real loopback processes that publish vLLM KV events for every block
they cache, so gpuhit's precise index is populated and its event decoding counted). Targets:

* ``direct``: the client round-robins over the two engines itself (the "added" baseline);
* ``gpuhit``: ``gpuhit serve --policy lpwl --index precise`` (default fast transport);
* ``vllm-router``: ``vllm-router --policy round_robin``;
* ``gpuhit-rr`` (only with ``GPUHIT_BENCH_RR=1``): ``gpuhit serve --policy round_robin``;
* ``gpuhit-before`` (only with ``GPUHIT_BENCH_BEFORE=<checkout>``): the same gpuhit command run from
  another checkout (its PYTHONPATH), for before/after numbers from one run (named
  ``$GPUHIT_BENCH_BEFORE_LABEL`` when set, e.g. ``gpuhit-pure`` for a checkout without ``make compile``).

Workloads: ``chat`` (a short chat request), ``2k`` (2,048 token ids, 16 prompts each sent again and
again: repeats, as retries and evaluation runs send), ``2k-new`` (2,048 token ids, a new prompt each
request), ``100k`` (100,000 token ids, a new prompt each request: every block hashed cold) and ``100k+512`` (agentic: each session's
prompt is its previous one plus 512 tokens, ``x-session-id`` sent; the warm-up pass is every
session's first turn, the measured pass its following turns), at concurrency 1/16/64,
streaming and not. Targets run interleaved per configuration, on distinct prompts (no state from
one configuration helps the next). Each router's CPU time is read from its threads'
``/proc/<pid>/task/*/schedstat`` (ns) around its measured pass (the warm-up pass excluded).

Prints per configuration: p50 latency, added p50 over direct, router CPU-ms per request,
throughput, the latency's p10, mean and p99 (a router can have the lower p50 and the higher mean: in
a closed loop the mean is concurrency / throughput, the p50 says how evenly requests are served),
and gpuhit / vllm-router ratios (of the medians, and per round: each round runs every
target back to back, so a round's ratio is a paired comparison; its median and range over the
rounds are printed with them, and the geometric mean of the rounds' ratios with its 95% t-interval
over their logs: with ``GPUHIT_BENCH_ROUNDS`` of 5 or more, an interval that excludes 1 says
which router uses less; the added p50s are compared the same way, as gpuhit's p50 minus
vllm-router's in each round, with the mean's 95% t-interval in ms). ``make bench`` runs it; ``GPUHIT_BENCH_SCALE`` scales
the request counts (default 1: a few minutes on 2 cores), ``GPUHIT_BENCH_ROUNDS`` repeats each
configuration (median of rounds; default 1), ``GPUHIT_BENCH_ONLY=chat,2k`` picks workloads,
``GPUHIT_BENCH_MOCK_EVENTS=per-request`` makes the mock engines publish a KV event batch per request
instead of one per event-loop iteration (vLLM publishes one per engine step),
``GPUHIT_BENCH_MOCK_BLOCKS`` sizes their caches (default 1,000,000 blocks; smaller ones evict, and the
index churns, from the first workloads on) and ``GPUHIT_BENCH_MOCK_REMOVED=per-block`` makes them
announce each evicted block in a ``BlockRemoved`` of its own, as vLLM 0.32 does (default: one a prompt);
``GPUHIT_BENCH_RAW=<file>`` writes every round's numbers as JSON (for statistics over several runs).
"""

from __future__ import annotations

import asyncio
import math
import os
import pathlib
import shutil
import statistics
import sys
import time

import aiohttp
import numpy as np
import orjson
import pytest
import scipy.stats

from gpuhit import speedups
from tests.e2e.helpers import Proc, spawn

HERE = pathlib.Path(__file__).resolve().parent
CONCURRENCY = tuple(int(c) for c in os.environ.get("GPUHIT_BENCH_CONCURRENCY", "1,16,64").split(",") if c)
STREAMS = tuple(s == "yes" for s in os.environ.get("GPUHIT_BENCH_STREAM", "no,yes").split(",") if s)
# The target the ratio columns compare gpuhit with (paired per round): vllm-router, or a
# GPUHIT_BENCH_BEFORE label for before/after tables.
VS = os.environ.get("GPUHIT_BENCH_VS", "vllm-router")
# Extra flags of this checkout's `gpuhit serve` (e.g. --no-c-speedups: its reference implementations
# while the mock engines, from the same checkout, keep the C speedups).
GPUHIT_ARGS = os.environ.get("GPUHIT_BENCH_GPUHIT_ARGS", "").split()
# More paired comparisons, each "a/b" (target labels), printed after the main table.
PAIRS = [p for p in os.environ.get("GPUHIT_BENCH_PAIRS", "").split(",") if p]
# A file to write every configuration's per-round numbers to (JSON), for statistics over several runs.
RAW = os.environ.get("GPUHIT_BENCH_RAW", "")
SCALE = float(os.environ.get("GPUHIT_BENCH_SCALE", "1"))
ROUNDS = int(os.environ.get("GPUHIT_BENCH_ROUNDS", "1"))
WORKLOADS = ("chat", "2k", "2k-new", "100k", "100k+512")
ONLY = tuple(w for w in os.environ.get("GPUHIT_BENCH_ONLY", ",".join(WORKLOADS)).split(",") if w)
# requests per measured pass, by workload and concurrency
REQUESTS = {
    "chat": {1: 300, 16: 800, 64: 1280},
    "2k": {1: 200, 16: 480, 64: 640},
    "2k-new": {1: 200, 16: 480, 64: 640},
    # 100k at c=16/64: eight requests a worker, so that the pass is mostly steady state, not the first
    # wave (every worker sending at once) and the last (a draining queue); before 2026-11-26 (stop 33)
    # 48 and 128, two or three a worker
    "100k": {1: 16, 16: 128, 64: 512},
    "100k+512": {1: 16, 16: 128, 64: 512},
}
# How the mock engines publish KV events: one batch per event-loop iteration, as vLLM per engine
# step (default), or one per request (this benchmark's mock before 2026-11-26).
MOCK_EVENTS = os.environ.get("GPUHIT_BENCH_MOCK_EVENTS", "per-step")
# The mock engines' KV cache in blocks (default 1,000,000: little is evicted before the 100k workloads),
# and how they announce evictions: one BlockRemoved a prompt (default) or one a block, as vLLM does.
MOCK_BLOCKS = os.environ.get("GPUHIT_BENCH_MOCK_BLOCKS", "1000000")
MOCK_REMOVED = os.environ.get("GPUHIT_BENCH_MOCK_REMOVED", "per-prompt")
ADDED_MIN = 0.02e-3  # seconds: an added p50 this small or negative is noise (see _print_table)
CLK = os.sysconf("SC_CLK_TCK")
VOCAB = 150_000


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every thread of ``pid`` (``/proc/<pid>/task/*/schedstat``, nanoseconds: the
    clock-tick utime + stime of ``/proc/<pid>/stat`` is 10 ms coarse, too coarse for 0.3 ms
    requests); falls back to utime + stime where schedstat is absent."""
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        if total:
            return total / 1e9
    except (OSError, ValueError, IndexError):
        pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


def _ids(seed: int, n: int) -> list[int]:
    # Token ids spread over a realistic vocabulary (1- to 6-digit ids, as a real tokenizer's).
    x = seed * 2654435761 % (1 << 32) | 1
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(x % VOCAB)
    return out


_JUMP = 1024  # steps _ids_many computes at once


def _ids_many(seeds: list[int], n: int) -> list[list[int]]:
    """``[_ids(s, n) for s in seeds]``, the same numbers, ~4x faster for a pass of 100k-token prompts
    (what keeps a pass long enough for steady state affordable): the generator jumps ahead, for every
    seed at once, by each of ``_JUMP`` steps from the last value of the previous jump (x_{k+j} =
    A_j x_k + C_j mod 2**31). Products stay below 2**62, so uint64 computes them exactly."""
    mask = (1 << 31) - 1
    mul, add = np.empty(_JUMP, dtype=np.uint64), np.empty(_JUMP, dtype=np.uint64)
    a, c = 1, 0
    for j in range(_JUMP):
        a, c = a * 1103515245 & mask, (c * 1103515245 + 12345) & mask
        mul[j], add[j] = a, c
    x = np.array([s * 2654435761 % (1 << 32) | 1 for s in seeds], dtype=np.uint64) & np.uint64(mask)
    out = np.empty((len(seeds), n), dtype=np.uint64)
    for k in range(0, n, _JUMP):
        block = (x[:, None] * mul[None, :] + add[None, :]) & np.uint64(mask)
        out[:, k:k + _JUMP] = block[:, :n - k] % np.uint64(VOCAB)
        x = block[:, -1]
    return out.tolist()


def bodies(workload: str, conf: int, concurrency: int, total: int, stream: bool) -> list[tuple[bytes, dict]]:
    """(body bytes, headers) of every request, in the order workers take them. ``conf`` makes the
    prompts of each configuration distinct from every other's."""
    extra: dict = {"max_tokens": 4, "stream": stream}
    if stream:
        extra["stream_options"] = {"include_usage": True}
    out = []
    if workload == "chat":
        for k in range(total):
            msgs = [{"role": "system", "content": "You are a helpful coding assistant."},
                    {"role": "user", "content": f"Request {conf}-{k}: what does this function return?"}]
            out.append((orjson.dumps({"model": "m", "messages": msgs, **extra}), {}))
        return out
    if workload in ("2k", "2k-new", "100k"):
        n = 100_000 if workload == "100k" else 2048
        # 2k: 16 distinct prompts per configuration, reused (repeats); 2k-new and 100k: all distinct
        keys = [k % 16 if workload == "2k" else k for k in range(total)]
        prompts = dict(zip(sorted(set(keys)), _ids_many([conf * 100_003 + key for key in sorted(set(keys))], n)))
        return [(orjson.dumps({"model": "m", "prompt": prompts[key], **extra}), {}) for key in keys]
    # agentic: worker w's session grows by 512 tokens a turn from a 100k-token start
    turns = -(-total // concurrency)
    per_worker = []
    for w in range(concurrency):
        ids = _ids(conf * 7_919 + w + 1, 100_000)
        seq = []
        for t in range(turns):
            ids = ids + _ids(conf * 31 + w * 977 + t + 7, 512)
            seq.append((orjson.dumps({"model": "m", "prompt": ids, **extra}), {"x-session-id": f"c{conf}-w{w}"}))
        per_worker.append(seq)
    return [per_worker[k % concurrency][k // concurrency] for k in range(total)]


def requests(workload: str, conf: int, concurrency: int, total: int, stream: bool
             ) -> tuple[list[tuple[bytes, dict]], list[tuple[bytes, dict]]]:
    """(warm-up, measured) requests: one per worker to warm up, on prompts of their own; for the
    agentic workload the warm-up is every session's first turn and the measured pass its next turns
    (steady state: each measured prompt extends one the router has seen)."""
    if workload == "100k+512":
        reqs = bodies(workload, conf, concurrency, total + concurrency, stream)
        return reqs[:concurrency], reqs[concurrency:]
    return bodies(workload, conf, concurrency, concurrency, stream), bodies(workload, conf + 10_000, concurrency,
                                                                            total, stream)


async def load(urls: list[str], path: str, concurrency: int, reqs: list[tuple[bytes, dict]]
               ) -> tuple[list[float], float, list[str]]:
    """Latencies of the 200 answers, wall time and the errors of sending ``reqs`` with
    ``concurrency`` workers; request k goes to ``urls[k % len(urls)]``. Worker w sends requests
    w, w + c, w + 2c, ... (a session's turns in order). An error answer (a router overloaded on a
    busy machine) is counted and reported, not fatal to the whole run."""
    clock = time.perf_counter
    lat: list[float] = []
    errors: list[str] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:

        async def worker(w: int) -> None:
            for k in range(w, len(reqs), concurrency):
                data, headers = reqs[k]
                t0 = clock()
                async with http.post(urls[k % len(urls)] + path, data=data,
                                     headers={"content-type": "application/json", **headers}) as r:
                    data = await r.read()
                if r.status != 200:
                    errors.append(f"{r.status} {data[:120].decode(errors='replace')}")
                    continue
                lat.append(clock() - t0)

        t0 = clock()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = clock() - t0
    return lat, wall, errors


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _spawn_url(args: list[str], marker: str) -> tuple[Proc, str]:
    p = await spawn(args)
    return p, p.first_line.split(marker, 1)[1].split(" ", 1)[0]


async def _vllm_router(engines: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    """vllm-router on a free port; waits until it answers /v1/models through an engine."""
    import socket

    exe = shutil.which("vllm-router") or str(pathlib.Path(sys.executable).parent / "vllm-router")
    with socket.socket() as s, socket.socket() as m:
        s.bind(("127.0.0.1", 0))
        m.bind(("127.0.0.1", 0))
        port, metrics_port = s.getsockname()[1], m.getsockname()[1]
    # Its Prometheus exporter on a free port too: on its default (29000) a second router, or one
    # left from an earlier run, makes it exit at start.
    proc = await asyncio.create_subprocess_exec(
        exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
        "--worker-urls", *engines, "--policy", "round_robin",
        "--log-level", "warning", "--disable-retries", "--disable-circuit-breaker", "--max-payload-size",
        str(64 << 20), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        for _ in range(600):
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.1)  # polling a child's readiness, not synchronizing with it
    proc.kill()
    raise AssertionError("vllm-router did not become ready")


@pytest.mark.timeout(3600)
def test_router_compare():
    if not (shutil.which("vllm-router") or (pathlib.Path(sys.executable).parent / "vllm-router").exists()):
        pytest.skip("vllm-router is not installed (pip install 'gpuhit[bench]')")

    async def main():
        procs: list[Proc] = []
        rows = []
        failed: list[str] = []
        vr = None
        try:
            engines = []
            for _ in range(2):
                p, u = await _spawn_url([str(HERE / "mock_engine.py"), "--events", MOCK_EVENTS, "--capacity",
                                         MOCK_BLOCKS, "--removed", MOCK_REMOVED], " on ")
                procs.append(p)
                engines.append(u)
            eng_args = [a for u in engines for a in ("--engine", u)]
            # the mock engines share the cores with the routers: their CPU per request is printed too
            engine_pids = [p.proc.pid for p in procs]
            targets: dict[str, tuple[int | None, list[str]]] = {"direct": (None, engines)}
            gw, url = await _spawn_url(["-m", "replayer.cli", "serve", "--port", "0", *eng_args, "--policy", "lpwl",
                                        "--index", "precise", "--model", "m", "--max-prompt-tokens", "0",
                                        *GPUHIT_ARGS], " on ")
            print(f"gpuhit: {gw.first_line}", flush=True)
            procs.append(gw)
            targets["gpuhit"] = (gw.proc.pid, [url])
            for label, before, flags in _befores():  # other gpuhit checkouts: before/after in one run
                # `python -m` would put this checkout (the cwd) first on sys.path: import from `before`
                # the command line's module in that checkout (it moved from gpuhit/ to replayer/)
                cli = "replayer.cli" if os.path.exists(os.path.join(before, "replayer", "cli.py")) else "gpuhit.cli"
                boot = f"import runpy, sys; sys.path.insert(0, {before!r}); runpy.run_module({cli!r}, " \
                       "run_name='__main__', alter_sys=True)"
                old = await spawn(["-c", boot, "serve", "--port", "0", *eng_args, "--policy", "lpwl", "--index",
                                   "precise", "--model", "m", "--max-prompt-tokens", "0", *flags],
                                  env={"PYTHONPATH": before})
                procs.append(old)
                targets[label] = (old.proc.pid, [old.first_line.split(" on ", 1)[1].split(" ", 1)[0]])
                print(f"{label}: {old.first_line}", flush=True)
            if os.environ.get("GPUHIT_BENCH_RR") == "1":
                rr, url = await _spawn_url(["-m", "replayer.cli", "serve", "--port", "0", *eng_args, "--policy",
                                            "round_robin", "--index", "precise", "--model", "m",
                                            "--max-prompt-tokens", "0"], " on ")
                procs.append(rr)
                targets["gpuhit-rr"] = (rr.proc.pid, [url])
            vr, url = await _vllm_router(engines)
            targets["vllm-router"] = (vr.pid, [url])
            conf = 0
            for workload in (w for w in WORKLOADS if w in ONLY):
                path = "/v1/chat/completions" if workload == "chat" else "/v1/completions"
                for stream in STREAMS:
                    for c in CONCURRENCY:
                        n = max(c, int(REQUESTS[workload][c] * SCALE))
                        got: dict[str, list[tuple[float, float, float]]] = {t: [] for t in targets}
                        for _ in range(ROUNDS):
                            for t, (pid, urls) in targets.items():
                                conf += 1
                                warm, reqs = requests(workload, conf, c, n, stream)
                                await load(urls, path, c, warm)
                                assert reqs
                                c0 = cpu_seconds(pid) if pid else 0.0
                                e0 = sum(cpu_seconds(p) for p in engine_pids)
                                lat, wall, errors = await load(urls, path, c, reqs)
                                cpu = (cpu_seconds(pid) - c0) * 1e3 / n if pid else 0.0
                                engine_cpu = (sum(cpu_seconds(p) for p in engine_pids) - e0) * 1e3 / n
                                nan = float("nan")
                                got[t].append((pct(lat, .5) if lat else nan, cpu, len(lat) / wall,
                                               statistics.fmean(lat) if lat else nan, pct(lat, .99) if lat else nan,
                                               pct(lat, .1) if lat else nan, engine_cpu))
                                if errors:
                                    failed.append(f"{t} {workload} stream={stream} c={c}: {len(errors)} errors, "
                                                  f"first: {errors[0]}")
                                    print("  " + failed[-1], flush=True)
                        med = {t: tuple(statistics.median(v[i] for v in got[t]) for i in range(7)) for t in got}
                        rows.append((workload, stream, c, n, med, got))
                        _print_row(rows[-1])
        finally:
            if vr is not None and vr.returncode is None:
                vr.kill()
                await vr.wait()
            for p in procs:
                await p.stop()
        _print_table(rows)
        if RAW:
            keys = ("p50_s", "cpu_ms_per_req", "req_per_s", "mean_s", "p99_s", "p10_s", "engine_cpu_ms_per_req")
            pathlib.Path(RAW).write_bytes(orjson.dumps([
                {"workload": w, "stream": st, "c": c, "n": n,
                 "rounds": {t: [dict(zip(keys, r)) for r in rs] for t, rs in got.items()}}
                for w, st, c, n, _med, got in rows]))
        for pair in PAIRS:
            _print_pair(rows, *pair.split("/", 1))
        for line in failed:
            print("errors:", line)

    import uvloop

    uvloop.run(main())


def _befores() -> list[tuple[str, str, list[str]]]:
    """(label, checkout, extra serve flags) of each other gpuhit to run beside this one:
    ``GPUHIT_BENCH_BEFORE`` is a checkout (labelled ``$GPUHIT_BENCH_BEFORE_LABEL``, default
    ``gpuhit-before``) or a comma-separated list of ``label=checkout[:flag...]`` (e.g.
    ``after-pure=/src/gpuhit:--no-c-speedups``)."""
    spec = os.environ.get("GPUHIT_BENCH_BEFORE", "")
    if not spec:
        return []
    if "=" not in spec:
        return [(os.environ.get("GPUHIT_BENCH_BEFORE_LABEL", "gpuhit-before"), spec, [])]
    out = []
    for part in spec.split(","):
        if part:
            label, rest = part.split("=", 1)
            path, *flags = rest.split(":")
            out.append((label, path, flags))
    return out


def _print_row(row) -> None:
    workload, stream, c, n, med, _ = row
    cells = " ".join(f"{t}={v[0]*1e3:.2f}ms/{v[1]:.3f}cpu/{v[2]:.0f}rps(p10 {v[5]*1e3:.2f} mean {v[3]*1e3:.2f} "
                     f"p99 {v[4]*1e3:.2f} engines {v[6]:.2f}cpu)"
                     for t, v in med.items())
    print(f"  {workload} stream={stream} c={c} n={n}: {cells}", flush=True)


def _ratio_interval(ratios: list[float]) -> str:
    """The paired per-round ratios' geometric mean and its 95% t-interval (over the rounds' log
    ratios: a ratio's scale is multiplicative), e.g. ``gm 1.07 (1.01-1.13)``; only the mean with one
    round."""
    logs = [math.log(r) for r in ratios if r > 0]
    if not logs:
        return "gm n/a"
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return f"gm {math.exp(m):.2f}"
    sem = scipy.stats.sem(logs)
    lo, hi = scipy.stats.t.interval(0.95, len(logs) - 1, loc=m, scale=sem) if sem > 0 else (m, m)
    return f"gm {math.exp(m):.2f} ({math.exp(lo):.2f}-{math.exp(hi):.2f})"


def _diff_interval(diffs: list[float]) -> str:
    """The paired per-round differences' mean and its 95% t-interval in ms, e.g. ``+3.1 (-1.2 to
    +7.4)``; only the mean with one round."""
    m = statistics.fmean(diffs) * 1e3
    if len(diffs) < 2:
        return f"{m:+.2f}"
    sem = scipy.stats.sem(diffs) * 1e3
    lo, hi = scipy.stats.t.interval(0.95, len(diffs) - 1, loc=m, scale=sem) if sem > 0 else (m, m)
    return f"{m:+.2f} ({lo:+.2f} to {hi:+.2f})"


def _added_ratio(g: tuple, v: tuple, direct: tuple, i: int) -> str:
    """gpuhit's latency statistic ``i`` over direct's, divided by vllm-router's. One at or below
    ADDED_MIN is within the noise of the direct run (a separate run): its ratio would read as 0 or
    thousands, so it is n/a."""
    ga, va = g[i] - direct[i], v[i] - direct[i]
    return f"{ga / va:.2f}" if min(ga, va) > ADDED_MIN else "n/a"


def _print_table(rows) -> None:
    routers = [t for t in rows[0][4] if t != "direct"] if rows else []
    print()
    print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f", scale {SCALE}, rounds {ROUNDS}, mock KV events {MOCK_EVENTS}, mock cache {MOCK_BLOCKS} blocks, "
          f"evictions {MOCK_REMOVED}, {'C speedups built' if speedups.load() is not None else 'pure Python'} (gateway and "
          "mock engines)")
    head = "| workload | stream | c | n | direct p50 ms |"
    for t in routers:
        head += f" {t} added p50 ms | {t} CPU-ms/req | {t} req/s |"
    head += (" added ratio | CPU ratio | req/s ratio | CPU ratio per round | req/s ratio per round |"
             " added p50 difference per round ms | added mean ratio | added p99 ratio |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for workload, stream, c, n, med, got in rows:
        d = med["direct"][0]
        direct = med["direct"]
        line = f"| {workload} | {'yes' if stream else 'no'} | {c} | {n} | {d*1e3:.2f} |"
        for t in routers:
            p50, cpu, rps = med[t][:3]
            line += f" {(p50 - d)*1e3:.2f} | {cpu:.3f} | {rps:.0f} |"
        g, v = med["gpuhit"], med[VS]
        line += f" {_added_ratio(g, v, direct, 0)} | {g[1] / max(v[1], 1e-9):.2f} | {g[2] / v[2]:.2f} |"
        # Each round runs every target back to back: the ratio within a round is a paired comparison.
        for i in (1, 2):
            paired = [a[i] / max(b[i], 1e-9) for a, b in zip(got["gpuhit"], got[VS])]
            line += f" {statistics.median(paired):.2f} [{min(paired):.2f}-{max(paired):.2f}] {_ratio_interval(paired)} |"
        # Within a round both routers' added p50s are over the same direct pass, which cancels from
        # their difference: gpuhit's p50 minus vllm-router's, round by round.
        line += f" {_diff_interval([a[0] - b[0] for a, b in zip(got['gpuhit'], got[VS])])} |"
        line += f" {_added_ratio(g, v, direct, 3)} | {_added_ratio(g, v, direct, 4)} |"
        print(line)
    print(f"(ratios are gpuhit / {VS}: added p50 and CPU lower is better, req/s higher is better; "
          "added mean and p99: the latency's mean and 99th percentile over direct's, the same way; "
          f"an added ratio is n/a where either added latency is at most {ADDED_MIN * 1e3:.2f} ms, within the direct "
          f"run's noise; per round: the median [min-max] of the {ROUNDS} rounds' paired ratios, then their "
          f"geometric mean and its 95% t-interval, n={ROUNDS}; added p50 difference: gpuhit's p50 minus "
          f"vllm-router's in the same round (the round's direct p50 cancels), mean and 95% t-interval over the "
          f"{ROUNDS} rounds: an interval below 0 says gpuhit adds less)")


def _print_pair(rows, a: str, b: str) -> None:
    """Target ``a`` against target ``b``, paired per round: CPU and throughput ratios and the
    difference of their p50s (each round's direct pass cancels from it)."""
    print()
    print(f"{a} / {b}, paired per round (median [min-max] of the rounds, geometric mean and its 95% t-interval):")
    print(f"| workload | stream | c | {a} CPU-ms/req | {b} CPU-ms/req | CPU ratio per round | req/s ratio per round "
          f"| p50 difference per round ms |")
    print("|---|---|---|---|---|---|---|---|")
    for workload, stream, c, n, med, got in rows:
        line = f"| {workload} | {'yes' if stream else 'no'} | {c} | {med[a][1]:.3f} | {med[b][1]:.3f} |"
        for i in (1, 2):
            paired = [x[i] / max(y[i], 1e-9) for x, y in zip(got[a], got[b])]
            line += f" {statistics.median(paired):.2f} [{min(paired):.2f}-{max(paired):.2f}] {_ratio_interval(paired)} |"
        line += f" {_diff_interval([x[0] - y[0] for x, y in zip(got[a], got[b])])} |"
        print(line)
