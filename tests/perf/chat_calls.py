"""Load-independent cost of one chat request in the gateway: Python function calls (cProfile) or
instructions (callgrind), per request, for any checkout.

Wall-clock and CPU-second ratios on a shared machine move with its load; counts do not. This
starts two mock engines (``tests/perf/mock_engine.py``, from this checkout) and one
``gpuhit serve --policy lpwl --index precise`` from ``--checkout`` (this one by default) with its
profiler off, warms it up, then measures two passes of the benchmark's chat request at
``--concurrency`` (``--small`` and ``--large`` requests) and prints the difference divided by the
difference in requests, so start-up, warm-up and the profiler's own switching cancel.

    python tests/perf/chat_calls.py --mode cprofile [--stream] [--checkout ../base] [-- --no-c-speedups]
    python tests/perf/chat_calls.py --mode callgrind ...   (valgrind on PATH)
    python tests/perf/chat_calls.py --mode perf --router vllm-router   (the Rust router, for comparison)

A checkout must import only itself: where the venv holds an editable gpuhit install of another
checkout, give that checkout a ``sitecustomize.py`` that drops the editable finder (see
``analysis/results/router-speed.md``). Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import pstats
import signal
import subprocess
import sys
import tempfile

import aiohttp
import orjson

HERE = pathlib.Path(__file__).resolve().parent
# --mode perf: what the kernel counts (task-clock is CPU ms: it moves with the load; the rest do not,
# beyond how requests bunch into event-loop turns)
PERF_EVENTS = ("raw_syscalls:sys_enter,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_epoll_pwait,context-switches,"
               "page-faults,task-clock")  # epoll_pwait: uvloop's wait

# Runs the checkout's command line with a cProfile profiler that SIGUSR1 switches on and SIGUSR2
# switches off and dumps (to $CHAT_CALLS_OUT.<k>).
_BOOT = """
import cProfile, os, runpy, signal, sys
sys.path.insert(0, @CHECKOUT@)
prof = cProfile.Profile()
dumps = [0]
def on(*_):
    prof.enable()
def off(*_):
    prof.disable()
    prof.dump_stats(os.environ["CHAT_CALLS_OUT"] + "." + str(dumps[0]))
    dumps[0] += 1
    prof.clear() if hasattr(prof, "clear") else None
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGUSR2, off)
if os.environ.get("CHAT_CALLS_OPCODES"):  # bytecodes per function instead, as a profile's call counts
    import collections, marshal
    counts = collections.Counter()
    live = [False]
    def local(frame, event, arg):
        if live[0] and event == "opcode":
            counts[frame.f_code] += 1
        return local
    def glob(frame, event, arg):
        frame.f_trace_opcodes = True
        return local
    def on(*_):
        counts.clear()
        live[0] = True
    def off(*_):
        live[0] = False
        rows = {(c.co_filename, c.co_firstlineno, c.co_name): (0, n, 0, 0, {}) for c, n in counts.items()}
        with open(os.environ["CHAT_CALLS_OUT"] + "." + str(dumps[0]), "wb") as f:
            marshal.dump(rows, f)
        dumps[0] += 1
    signal.signal(signal.SIGUSR1, on)
    signal.signal(signal.SIGUSR2, off)
    sys.settrace(glob)
    import threading
    threading.settrace(glob)
runpy.run_module(@CLI@, run_name="__main__", alter_sys=True)
"""


def chat_bodies(tag: str, n: int, stream: bool) -> list[bytes]:
    """The benchmark's chat request (tests/perf/test_router_compare.py ``bodies``), ``n`` distinct."""
    extra: dict = {"max_tokens": 4, "stream": stream}
    if stream:
        extra["stream_options"] = {"include_usage": True}
    return [orjson.dumps({"model": "m", "messages": [
        {"role": "system", "content": "You are a helpful coding assistant."},
        {"role": "user", "content": f"Request {tag}-{k}: what does this function return?"}], **extra})
        for k in range(n)]


async def send(url: str, bodies: list[bytes], concurrency: int) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def worker(w: int) -> None:
            for k in range(w, len(bodies), concurrency):
                async with http.post(url + "/v1/chat/completions", data=bodies[k],
                                     headers={"content-type": "application/json"}) as r:
                    await r.read()
                    if r.status != 200:
                        raise SystemExit(f"status {r.status}")

        await asyncio.gather(*(worker(w) for w in range(concurrency)))


def proc_counters(pid: int) -> dict[str, int]:
    """The process's read / write system calls, context switches and CPU ns (all its threads)."""
    out = {"syscr": 0, "syscw": 0, "voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0, "cpu_ns": 0,
           "utime_ticks": 0, "stime_ticks": 0}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, _, v = line.partition(":")
            if key in out:
                out[key] = int(v)
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            for line in f:
                key, _, v = line.partition(":")
                if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                    out[key] += int(v)
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            out["cpu_ns"] += int(f.read().split()[0])
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
            out["utime_ticks"] += int(fields[11])
            out["stime_ticks"] += int(fields[12])
    return out


def first_line(p: subprocess.Popen) -> str:
    assert p.stdout is not None
    line = p.stdout.readline().decode()
    if " on " not in line:
        raise SystemExit(f"{p.args!r} printed {line!r}")
    return line.split(" on ", 1)[1].split(" ", 1)[0].strip()  # "... on http://host:port ..."


def vllm_router_command(engines: list[str]) -> list[str]:
    """vllm-router on a free port, round robin, as the benchmark runs it."""
    import shutil
    import socket

    exe = shutil.which("vllm-router") or str(pathlib.Path(sys.executable).parent / "vllm-router")
    with socket.socket() as s, socket.socket() as m:
        s.bind(("127.0.0.1", 0))
        m.bind(("127.0.0.1", 0))
        port, metrics_port = s.getsockname()[1], m.getsockname()[1]
    return [exe, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
            "--worker-urls", *engines, "--policy", "round_robin", "--log-level", "warning", "--disable-retries",
            "--disable-circuit-breaker", "--max-payload-size", str(64 << 20)]


def wait_ready(cmd: list[str], p: subprocess.Popen) -> str:
    """The URL of the vllm-router ``cmd`` started, once it answers /health."""
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"

    async def probe() -> bool:
        try:
            async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
                return r.status == 200
        except aiohttp.ClientError:
            return False

    for _ in range(600):
        if asyncio.run(probe()):
            return url
        if p.poll() is not None:
            break
        asyncio.run(asyncio.sleep(0.1))  # polling a child's readiness
    raise SystemExit("vllm-router did not become ready")


def traced(cmd: list[str], batch) -> None:
    """Run ``batch`` (a coroutine, not yet started) while the tracer ``cmd`` (strace / perf, attached to the
    gateway's pid) counts, then stop the tracer so it writes its totals."""
    st = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    asyncio.run(asyncio.sleep(1.0))  # the tracer attaches to every thread
    asyncio.run(batch)
    st.send_signal(signal.SIGINT)
    st.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("cprofile", "opcodes", "callgrind", "strace", "perf", "proc"), default="cprofile",
                    help="cprofile: Python function calls; opcodes: bytecodes run, per function (slow); "
                         "callgrind: machine instructions; strace: system calls, by name; perf: system calls, context "
                         "switches and page faults counted by the kernel's tracepoints at full speed (perf on PATH; "
                         "strace slows every call, and so bunches requests); proc: /proc counters "
                         "(read / write system calls, context switches, CPU ns: the last depends on load)")
    ap.add_argument("--checkout", default=str(HERE.parent.parent))
    ap.add_argument("--router", choices=("gpuhit", "vllm-router"), default="gpuhit",
                    help="vllm-router (round robin, as tests/perf/test_router_compare.py runs it): the modes that "
                         "count what the kernel sees (strace, perf, proc)")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--large", type=int, default=1000)
    ap.add_argument("--cache-sim", action="store_true", help="callgrind: simulate the caches too (misses)")
    ap.add_argument("--branch-sim", action="store_true",
                    help="callgrind: simulate the branch predictors too (mispredicted conditional / indirect branches)")
    ap.add_argument("--top", type=int, default=40, help="functions listed (cprofile)")
    ap.add_argument("flags", nargs="*", help="more `gpuhit serve` flags (after --)")
    a = ap.parse_args()
    if a.router == "vllm-router" and a.mode not in ("strace", "perf", "proc"):
        ap.error("--router vllm-router counts only what the kernel sees: --mode strace, perf or proc")
    checkout = os.path.abspath(a.checkout)
    cli = "replayer.cli" if os.path.exists(os.path.join(checkout, "replayer", "cli.py")) else "gpuhit.cli"
    tmp = tempfile.mkdtemp(prefix="chat-calls-")
    procs: list[subprocess.Popen] = []
    try:
        engines = []
        for _ in range(2):
            p = subprocess.Popen([sys.executable, str(HERE / "mock_engine.py")], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT)
            procs.append(p)
            engines.append(first_line(p))
        serve = ["serve", "--port", "0", *(x for u in engines for x in ("--engine", u)), "--policy", "lpwl",
                 "--index", "precise", "--model", "m", "--max-prompt-tokens", "0", *a.flags]
        env = {**os.environ, "PYTHONPATH": checkout, "CHAT_CALLS_OUT": os.path.join(tmp, "prof")}
        if a.mode == "opcodes":
            env["CHAT_CALLS_OPCODES"] = "1"
        if a.router == "vllm-router":
            cmd = vllm_router_command(engines)
        elif a.mode in ("cprofile", "opcodes", "strace", "perf", "proc"):
            cmd = [sys.executable, "-c", _BOOT.replace("@CHECKOUT@", repr(checkout)).replace("@CLI@", repr(cli)), *serve]
        else:
            boot = f"import runpy, sys; sys.path.insert(0, {checkout!r}); " \
                   f"runpy.run_module({cli!r}, run_name='__main__', alter_sys=True)"
            cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--log-file={tmp}/valgrind.log",
                   *(["--cache-sim=yes"] if a.cache_sim else []), *(["--branch-sim=yes"] if a.branch_sim else []),
                   f"--callgrind-out-file={tmp}/cg.%p", sys.executable, "-c", boot, *serve]
        quiet = a.router == "vllm-router"  # it prints no address line to read; its log must not fill a pipe
        gw = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if quiet else subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, cwd=tmp)
        procs.append(gw)
        url = first_line(gw) if a.router == "gpuhit" else wait_ready(cmd, gw)
        asyncio.run(send(url, chat_bodies("warm", 400, a.stream), a.concurrency))
        counts = []
        for k, n in enumerate((a.small, a.large)):
            if a.mode == "proc":
                before = proc_counters(gw.pid)
                asyncio.run(send(url, chat_bodies(f"p{k}", n, a.stream), a.concurrency))
                after = proc_counters(gw.pid)
                counts.append({key: after[key] - before[key] for key in after})
            elif a.mode == "strace":
                out = os.path.join(tmp, f"strace.{k}")
                traced(["strace", "-f", "-c", "-o", out, "-p", str(gw.pid)],
                       send(url, chat_bodies(f"p{k}", n, a.stream), a.concurrency))
                calls = {}
                with open(out) as fh:
                    for line in fh:
                        f = line.split()
                        if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
                            calls[f[-1]] = int(f[3])
                counts.append(calls)
            elif a.mode == "perf":
                out = os.path.join(tmp, f"perf.{k}")
                traced(["perf", "stat", "-x", ",", "-o", out, "-e", PERF_EVENTS, "-p", str(gw.pid)],
                       send(url, chat_bodies(f"p{k}", n, a.stream), a.concurrency))
                events = {}
                with open(out) as fh:
                    for line in fh:
                        f = line.split(",")
                        if len(f) > 2 and f[0].replace(".", "").isdigit():
                            events[f[2]] = float(f[0])
                counts.append(events)
            elif a.mode != "callgrind":
                gw.send_signal(signal.SIGUSR1)
                asyncio.run(send(url, chat_bodies(f"p{k}", n, a.stream), a.concurrency))
                gw.send_signal(signal.SIGUSR2)
                out = os.path.join(tmp, f"prof.{k}")
                for _ in range(600):
                    if os.path.exists(out):
                        break
                    asyncio.run(asyncio.sleep(0.05))  # polling for the child's dump file
                asyncio.run(asyncio.sleep(0.5))  # the dump is written in one go; let it finish
                counts.append(pstats.Stats(out))
            else:
                subprocess.run(["callgrind_control", "-i", "on", str(gw.pid)], check=True, capture_output=True)
                asyncio.run(send(url, chat_bodies(f"p{k}", n, a.stream), a.concurrency))
                subprocess.run(["callgrind_control", "-i", "off", str(gw.pid)], check=True, capture_output=True)
                subprocess.run(["callgrind_control", "-d", str(gw.pid)], check=True, capture_output=True)
                counts.append(None)
        dn = a.large - a.small
        if a.mode in ("proc", "perf"):
            c0, c1 = counts
            for key in c1:
                print(f"{key} per request: {(c1[key] - c0[key]) / dn:.4g}")
        elif a.mode == "strace":
            c0, c1 = counts
            print(f"system calls per request: {(sum(c1.values()) - sum(c0.values())) / dn:.2f}")
            for name in sorted(set(c0) | set(c1), key=lambda x: -(c1.get(x, 0) - c0.get(x, 0))):
                print(f"{(c1.get(name, 0) - c0.get(name, 0)) / dn:8.2f}  {name}")
        elif a.mode != "callgrind":
            s0, s1 = (c.stats for c in counts)  # type: ignore[union-attr]
            tot0 = sum(v[1] for v in s0.values())
            tot1 = sum(v[1] for v in s1.values())
            what = "function calls" if a.mode == "cprofile" else "bytecodes"
            print(f"{what} per request: {(tot1 - tot0) / dn:.1f} "
                  f"({tot0} in {a.small}, {tot1} in {a.large})")
            rows = []
            for key, v in s1.items():
                d = (v[1] - s0.get(key, (0, 0))[1]) / dn
                if abs(d) >= 0.05:
                    rows.append((d, f"{key[0].replace(checkout + '/', '')}:{key[1]}({key[2]})"))
            rows.sort(reverse=True)
            for d, name in rows[:a.top]:
                print(f"{d:8.2f}  {name}")
        else:
            import glob

            files = sorted(glob.glob(f"{tmp}/cg.{gw.pid}.*"), key=os.path.getmtime)
            totals = []
            for f in files:
                with open(f) as fh:
                    totals += [[int(x) for x in line.split()[1:]] for line in fh if line.startswith("totals:")]
                with open(f) as fh:
                    events = next((line.split()[1:] for line in fh if line.startswith("events:")), ["Ir"])
            if len(totals) < 2:
                raise SystemExit(f"callgrind dumps {files}: {totals}")
            t0, t1 = totals[-2], totals[-1]
            i0, i1 = t0[0], t1[0]
            print(f"instructions per request: {(i1 - i0) / dn:.0f} ({i0} in {a.small}, {i1} in {a.large})")
            for name, x0, x1 in list(zip(events, t0, t1))[1:]:
                print(f"{name} per request: {(x1 - x0) / dn:.0f}")
            print(f"dumps: {files[-2]} {files[-1]}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
