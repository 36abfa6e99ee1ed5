"""The live A/B protocol on a shared host, in one high-priority, time-boxed, resumable run.

Starts the real vLLM pair of ``analysis/results/live-ab.md`` (two engines, one core each, 256 KV blocks
of 32 tokens), fits the emulator profile on them (``gpuhit profile fit``), runs ``gpuhit experiment
ab-live`` at the load where queues form (all policies, paired seeds), one repeated seed, the light
load as far as the time allows, and a second fit at the end (does the profile hold over the window?),
then stops the engines, whatever happens, by ``--stop-at``. ``gpuhit experiment sim-vs-real`` runs
afterwards (virtual time: no engines, no priority needed), with each ``--live-path`` model to compare.

Why it raises the CPU priority of its *sessions* and not only its processes' nice value: with
``kernel.sched_autogroup_enabled=1`` (the default on many distributions) the scheduler first shares a
core between sessions (autogroups), and a process's nice value only ranks it within its own session.
Every shell of every other job is its own session, so ``nice -n -15`` alone buys nothing against them;
and vLLM's launcher starts each engine in a session of its own (``start_new_session``). This script
sets the autogroup nice of its own session and of each engine's session (``/proc/PID/autogroup``),
and samples every ``--sample-every`` seconds the scheduler's run-queue delay of those sessions
(``/proc/PID/task/*/schedstat``): the time they were ready to run but waited for a core.

    setsid nice -n -15 python tests/perf/live_ab_window.py --out results/live-window \
        --not-before 09:30 --stop-at 10:03   # UTC times of today

Run again with the same ``--out`` to resume: a finished fit is kept, ``ab-live`` skips finished runs.
Needs root (negative nice) and the vLLM venv (``GPUHIT_VLLM_PYTHON``). ``--report`` prints, from a
finished folder, each step's CPU and run-queue delay (ours and the rest of the host's CPU) and the
repeated seed's spread, as markdown; ``--compare LABEL=DIR ...`` the before/after tables of
``gpuhit experiment sim-vs-real`` results of one live folder (``tests/perf/live_ab_report.py``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

POLICIES = "round_robin,least_request,lmetric,linear,lpwl,lpwl_resident,lpwl_resident_prio,lpwl_auto"
REFERENCE = "lpwl_auto"
TRACE = ["--max-sessions", "8", "--max-turns", "4", "--max-prompt", "1800", "--max-output", "16", "--max-think", "2",
         "--time-scale", "0.05"]
# the live path is probed alone and under load: closed loops of 1-9 clients sending cold prompts of the
# trace's sizes through a gateway, so that each meets 0-8 others in flight (replayer/calibrate_path.py);
# and how much the two engines slow each other down: the same cold prompts on each alone, then on both
# (replayer/calibrate_host.py), 16 per engine and level; and the frontends' CPU seconds per request and
# per output token (replayer/calibrate_cpu.py): 32 requests answered with 1 and with 32 tokens; and the
# stall tail request by request (replayer/calibrate_stalls.py): 48 per engine, both engines at once
FIT = ["--name", "cpu-prefill-model", "--max-num-batched-tokens", "2048", "--max-num-seqs", "128",
       "--kv-bytes-per-token", "4096", "--path-in-flight", "0,1,2,4,8", "--path-requests", "32",
       "--path-output-tokens", "16", "--contention-requests", "16", "--cpu-requests", "32", "--cpu-tokens", "1,32",
       "--stall-requests", "48"]


def trace_prompt_sizes() -> str:
    """The prompt sizes of the experiment's trace (every turn's, as ``--path-prompts``): the live path's
    load during the fit is made of requests like the run's, sent cold."""
    from replayer.ab_live import experiment_trace

    flags = dict(zip(TRACE[::2], TRACE[1::2]))
    trace = experiment_trace({"paths": [], "max_sessions": int(flags["--max-sessions"]),
                              "max_turns": int(flags["--max-turns"]), "max_prompt": int(flags["--max-prompt"]),
                              "max_output": int(flags["--max-output"])})
    return ",".join(str(t.input_length) for s in trace.sessions for t in s.turns)
GPUHIT = [str(pathlib.Path(sys.executable).with_name("gpuhit"))]


def utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def at_today(hhmm: str) -> dt.datetime:
    h, m = (int(x) for x in hhmm.split(":")[:2])
    s = int(hhmm.split(":")[2]) if hhmm.count(":") == 2 else 0
    return utc().replace(hour=h, minute=m, second=s, microsecond=0)


class Log:
    def __init__(self, path: pathlib.Path):
        self.path = path

    def __call__(self, msg: str) -> None:
        la = " ".join(f"{x:.2f}" for x in os.getloadavg())
        line = f"{utc():%H:%M:%S} load {la} {msg}"
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def set_autogroup_nice(pid: int, nice: int) -> str:
    """Set the autogroup (session) nice of ``pid``; what /proc says afterwards."""
    p = pathlib.Path(f"/proc/{pid}/autogroup")
    try:
        p.write_text(f"{nice}\n")
        return p.read_text().strip()
    except OSError as e:
        return f"autogroup not set ({e})"


def session_of(pid: int) -> int | None:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])  # fields after comm: state ppid pgrp session


def roles(sids: dict[str, int]) -> dict[str, list]:
    """Per live process of our sessions: [session name, parent pid, command name] (which process is an
    API server, an engine core, the gpuhit command running the gateway and the replayer)."""
    out = {}
    by_sid = {v: k for k, v in sids.items()}
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat.rsplit(")", 1)[1].split()
        name = by_sid.get(int(f[3]))
        if name is not None:
            out[d.name] = [name, int(f[1]), comm]
    return out


def threads(pids: list[str]) -> dict[str, dict[str, list]]:
    """Per process of ``pids``, per thread: [CPU s (utime + stime), the core it last ran on, its name]:
    which of an engine's threads are pinned to its core and which float."""
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[str, dict[str, list]] = {}
    for pid in pids:
        try:
            tasks = list(pathlib.Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                stat = (t / "stat").read_text()
            except OSError:
                continue
            f = stat.rsplit(")", 1)[1].split()
            out.setdefault(pid, {})[t.name] = [(int(f[11]) + int(f[12])) / hz, int(f[36]),
                                               stat[stat.index("(") + 1:stat.rindex(")")]]
    return out


def schedstat(sids: dict[str, int]) -> dict[str, dict[str, list[float]]]:
    """Per named session, per live process: [cpu s, run-queue delay s] summed over its threads (per
    process, so that a process that exits between two samples can be left out of that interval)."""
    out: dict[str, dict[str, list[float]]] = {k: {} for k in sids}
    by_sid = {v: k for k, v in sids.items()}
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        name = by_sid.get(session_of(int(d.name)) or -1)
        if name is None:
            continue
        tot = [0.0, 0.0]
        try:
            for t in (d / "task").iterdir():
                cpu, delay, _ = (int(x) for x in (t / "schedstat").read_text().split())
                tot[0] += cpu / 1e9
                tot[1] += delay / 1e9
        except OSError:
            continue
        out[name][d.name] = tot
    return out


def cpu_totals() -> list[int]:
    """/proc/stat's aggregate cpu line: user nice system idle iowait irq softirq steal."""
    return [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]


class Sampler(threading.Thread):
    """Every ``every`` s: load average, whole-host CPU counters and our sessions' CPU and run-queue delay."""

    def __init__(self, path: pathlib.Path, sids: dict[str, int], every: float):
        super().__init__(daemon=True)
        self.path, self.sids, self.every = path, sids, every
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rl = roles(dict(self.sids))
            rec = {"utc": utc().isoformat(timespec="seconds"), "load": os.getloadavg(), "cpu": cpu_totals(),
                   "ours": schedstat(dict(self.sids)), "roles": rl,
                   "threads": threads([p for p, r in rl.items() if r[0].startswith("vllm")])}
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            self.stop.wait(self.every)


def run_step(log: Log, name: str, argv: list[str], out: pathlib.Path, deadline: dt.datetime) -> int | None:
    """Run one gpuhit command until it ends or ``deadline`` (then SIGINT, then SIGKILL); its exit status."""
    left = (deadline - utc()).total_seconds()
    if left < 20:
        log(f"{name}: skipped, {left:.0f} s left")
        return None
    log(f"{name} start: gpuhit {' '.join(argv[1:])}")
    with (out / f"{name}.out").open("ab") as so, (out / f"{name}.err").open("ab") as se:
        proc = subprocess.Popen(argv, stdout=so, stderr=se)
        try:
            rc = proc.wait(left)
        except subprocess.TimeoutExpired:
            log(f"{name}: deadline reached, interrupting")
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    log(f"{name} exit {rc}")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--report", action="store_true", help="print the step and repeat tables of a finished --out")
    ap.add_argument("--compare", nargs="+", metavar="LABEL=DIR", help="print the before/after table of "
                    "`gpuhit experiment sim-vs-real --out DIR` results of one live folder, one column per LABEL")
    ap.add_argument("--not-before", default=None, metavar="HH:MM", help="UTC time to wait for")
    ap.add_argument("--stop-at", default=None, metavar="HH:MM[:SS]", help="UTC time the engines are stopped by")
    ap.add_argument("--nice", type=int, default=-15, help="autogroup nice of our sessions (default -15)")
    ap.add_argument("--seeds", type=int, default=3, help="paired seeds at the load where queues form (default 3)")
    ap.add_argument("--rate", default="3", help="the load where queues form, sessions/s (default 3)")
    ap.add_argument("--light-rate", default="0.6", help="the light load, sessions/s (default 0.6; 0 skips it)")
    ap.add_argument("--repeat-seeds", type=int, default=1, help="seeds repeated at --rate (default 1; 0 skips)")
    ap.add_argument("--light-seeds", type=int, default=None, help="paired seeds at the light load (default --seeds)")
    ap.add_argument("--repeat-reserve", type=float, default=0.0,
                    help="seconds kept for the repeated seed and the second fit when the light load is skipped: "
                         "the heavy load's paired seeds stop that long before --stop-at (default 0: no limit)")
    ap.add_argument("--fit-after-reserve", type=float, default=150.0,
                    help="seconds kept for the second fit before --stop-at (default 150)")
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--engine-spans", action="store_true",
                    help="engines export their per-request spans to a collector this script runs for the window "
                         "(python -m gpuhit.otlp_collector OUT/engine-spans.jsonl), which ab-live joins to the "
                         "records (--span-file): each live request split by vLLM's own timings")
    ap.add_argument("--idle-s", type=float, default=0.0, help="seconds the engines stay idle before the fit, "
                    "sampled: their CPU without requests (default 0: no idle step)")
    args = ap.parse_args()
    if args.compare or args.report:
        from live_ab_report import compare_report, repeat_report, roles_report, sched_report, threads_report
    if args.compare:
        docs = {lb: json.loads((pathlib.Path(d) / "sim-vs-real.json").read_text())
                for lb, d in (a.split("=", 1) for a in args.compare)}
        print(compare_report(docs))
        return 0
    if args.report:
        out = pathlib.Path(args.out)
        print(sched_report(out) + "\n\n" + roles_report(out) + "\n\n" + "\n\n".join(
            threads_report(out, step) for step in ("idle", "ab")) + "\n\n" + repeat_report(out))
        return 0
    if not args.stop_at or not args.out:
        ap.error("--out and --stop-at are required to run the window")

    from engines.vllm.launch import make_server
    from engines.vllm.venv import TINY_MODEL_DIR

    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "window.log")
    stop_at = at_today(args.stop_at)
    if args.not_before:
        start = at_today(args.not_before)
        while utc() < start:
            time.sleep(min(5.0, (start - utc()).total_seconds() + 0.1))  # wall-clock wait for the window
    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # a kill of the driver still stops the engines
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True).stdout.strip()
    log(f"start commit {commit} pid {os.getpid()} nice {os.nice(0)} session {session_of(os.getpid())} "
        f"{set_autogroup_nice(os.getpid(), args.nice)}; stop at {stop_at:%H:%M:%S}")
    sids = {"driver": session_of(os.getpid()) or os.getpid()}
    sampler = Sampler(out / "sched.jsonl", sids, args.sample_every)
    sampler.start()
    model = str(TINY_MODEL_DIR.with_name("prefill_model"))
    collector, tracing, span_args = None, {}, []
    if args.engine_spans:  # in this session: at its priority, stopped with it
        from engines.vllm.launch import free_port
        from replayer.engine_spans import engine_tracing

        port = free_port()
        collector = subprocess.Popen([sys.executable, "-m", "gpuhit.otlp_collector", str(out / "engine-spans.jsonl"),
                                      "--port", str(port)], stdout=subprocess.PIPE, text=True)
        assert collector.stdout is not None
        log(f"span collector pid {collector.pid} on port {collector.stdout.readline().strip()}")
        tracing = engine_tracing(f"http://127.0.0.1:{port}/v1/traces")
        span_args = ["--span-file", str(out / "engine-spans.jsonl")]
    servers = [make_server(out / "engine-logs", f"vllm{i}", model=model, tokenizer=str(TINY_MODEL_DIR),
                           cpu_cores=str(i), num_gpu_blocks=256, max_model_len=2048, block_size=32,
                           max_num_batched_tokens=2048, max_num_seqs=128, scheduling_policy="priority", **tracing)
               for i in range(2)]
    try:
        for i, s in enumerate(servers):
            s.start()
            assert s.proc is not None
            sids[f"vllm{i}"] = s.proc.pid  # its own session (start_new_session)
            log(f"vllm{i} pid {s.proc.pid} {s.url}: {set_autogroup_nice(s.proc.pid, args.nice)}")
        for s in servers:
            s.wait_ready(max(10.0, (stop_at - utc()).total_seconds() - 30))
        urls = [s.url for s in servers]
        eng = [a for u in urls for a in ("--engine", u)]
        (out / "engines.json").write_text(json.dumps({"urls": urls, "argv": [s.argv for s in servers],
                                                      "env": [{k: v for k, v in s.env.items() if k.startswith("VLLM_")}
                                                              for s in servers]}, indent=1))
        log("engines ready " + " ".join(eng))
        ps = subprocess.run(["ps", "-o", "pid,ni,psr,comm", "--sid", ",".join(str(v) for v in sids.values())],
                            check=False, capture_output=True, text=True).stdout
        log("our processes:\n" + ps)
        if args.idle_s > 0:  # the engines' and API servers' CPU with no request at all (a spinning worker shows)
            log("idle start: no requests")
            time.sleep(args.idle_s)  # wall-clock interval of the window
            log("idle exit 0")
        fit_s = None
        fit = [*FIT, "--path-prompts", trace_prompt_sizes()]
        if not (out / "profile.json").exists():
            t0 = time.monotonic()
            run_step(log, "fit", [*GPUHIT, "profile", "fit", *eng, "--out", str(out / "profile.json"), *fit,
                                  "--repeats", "2", "--gateway-pairs", "16"], out, stop_at)
            fit_s = time.monotonic() - t0
        else:
            log("fit: profile.json exists (an earlier start of this window), kept")
        ab = [*GPUHIT, "experiment", "ab-live", *eng, *TRACE, "--policies", POLICIES, "--reference", REFERENCE,
              *span_args]
        run_step(log, "ab", [*ab, "--session-rate", args.rate, "--seeds", str(args.seeds), "--out", str(out / "ab")],
                 out, stop_at - dt.timedelta(seconds=args.repeat_reserve))
        if args.repeat_seeds:
            run_step(log, "repeat", [*ab, "--session-rate", args.rate, "--seeds", str(args.repeat_seeds), "--out",
                                     str(out / "repeat")], out, stop_at)
        # the second fit probes each shape twice as the first (one repeat a shape: a stall on one engine
        # is half the shape's median) with half the gateway pairs: ~0.9 of the first's time
        reserve = args.fit_after_reserve if fit_s is None else min(max(0.9 * fit_s + 30, 60.0), 270.0)
        light_deadline = stop_at - dt.timedelta(seconds=reserve)
        log(f"light load until {light_deadline:%H:%M:%S} (second fit reserve {reserve:.0f} s)")
        if float(args.light_rate):
            run_step(log, "ab-light", [*ab, "--session-rate", args.light_rate, "--seeds", str(args.light_seeds or args.seeds),
                                       "--out", str(out / "ab-light")], out, light_deadline)
        if not (out / "profile-after.json").exists():
            run_step(log, "fit-after", [*GPUHIT, "profile", "fit", *eng, "--out", str(out / "profile-after.json"), *fit,
                                        "--repeats", "2", "--gateway-pairs", "8"], out, stop_at)
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        for s in servers:
            s.stop()
        if collector is not None:
            collector.terminate()
            collector.wait(10)
        sampler.stop.set()
        sampler.join(30)
        log("engines stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
