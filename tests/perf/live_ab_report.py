"""Reports of a live window's folder (``tests/perf/live_ab_window.py --report`` / ``--compare``): each
step's CPU and run-queue delay from the sampled ``/proc`` counters, the repeated seed against its
first run, and ``gpuhit experiment sim-vs-real`` results of one live folder side by side."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import pathlib


def _delta(a: dict[str, dict[str, list[float]]], b: dict[str, dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per session: [cpu s, delay s] between two samples, over the processes alive at both (a process
    whose threads exited in between loses their counters: its interval counts 0, not a negative)."""
    return {k: [sum(max(0.0, b[k][p][i] - a.get(k, {}).get(p, b[k][p])[i]) for p in b[k]) for i in (0, 1)] for k in b}


def steps_of(log_path: pathlib.Path) -> list[tuple[str, dt.datetime, dt.datetime]]:
    """(step, start, end) from the window log ("HH:MM:SS load a b c NAME start: ..." / "NAME exit RC")."""
    day = dt.datetime.now(dt.UTC).date()
    open_: dict[str, dt.datetime] = {}
    out = []
    for line in log_path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 7 or ":" not in parts[0]:
            continue
        t = dt.datetime.combine(day, dt.time.fromisoformat(parts[0]), dt.UTC)
        name, what = parts[5], parts[6].rstrip(":")
        if what == "start":
            open_[name] = t
        elif what == "exit" and name in open_:
            out.append((name, open_.pop(name), t))
    return out


def sched_report(out: pathlib.Path) -> str:
    """Per step: wall time, our sessions' CPU and run-queue delay, the host's CPU busy and others' part."""
    samples = [json.loads(x) for x in (out / "sched.jsonl").read_text().splitlines() if x.strip()]
    for s in samples:
        s["t"] = dt.datetime.fromisoformat(s["utc"])
    rows = [("| step | UTC | wall s | load 1-min | our CPU s (driver / vllm0 / vllm1) | our run-queue delay s | "
             "delay per our CPU s | host CPU busy % of 2 cores | others' CPU s |"), "|" + "---|" * 9]
    for name, t0, t1 in steps_of(out / "window.log"):
        win = [s for s in samples if t0 - dt.timedelta(seconds=5) <= s["t"] <= t1 + dt.timedelta(seconds=5)]
        if len(win) < 2:
            continue
        a, b = win[0], win[-1]
        wall = (b["t"] - a["t"]).total_seconds()
        cpu: dict[str, float] = {}
        delay = 0.0
        for x, y in itertools.pairwise(win):
            for k, (c, dl) in _delta(x["ours"], y["ours"]).items():
                cpu[k] = cpu.get(k, 0.0) + c
                delay += dl
        ticks = [y - x for x, y in zip(a["cpu"], b["cpu"])]
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(ticks) - ticks[3] - ticks[4]) / hz
        loads = [s["load"][0] for s in win]
        ours = sum(cpu.values())
        rows.append(f"| {name} | {t0:%H:%M:%S}-{t1:%H:%M:%S} | {wall:.0f} | {min(loads):.1f}-{max(loads):.1f} | "
                    f"{ours:.0f} ({' / '.join(f'{cpu.get(k, 0):.0f}' for k in ('driver', 'vllm0', 'vllm1'))}) | "
                    f"{delay:.1f} | {delay / ours if ours else float('nan'):.3f} | "
                    f"{busy / (2 * wall) * 100:.0f} | {busy - ours:.0f} |")
    return "\n".join(rows)


def _role(roles: dict[str, list], pid: str) -> str:
    """A process's role: its session and command name, ``API server`` for the process that vLLM's
    launcher started (its parent is outside the session)."""
    sess, ppid, comm = roles[pid]
    parent = roles.get(str(ppid))
    if sess.startswith("vllm") and (parent is None or parent[0] != sess):
        return f"{sess} API server"
    return f"{sess} {comm}"


def roles_report(out: pathlib.Path) -> str:
    """Per step and process role: CPU seconds, mean cores, and for the steps that ran A/B experiments
    (``ab``, ``repeat``) CPU milliseconds per request sent, from the sampled per-process counters."""
    samples = [json.loads(x) for x in (out / "sched.jsonl").read_text().splitlines() if x.strip()]
    samples = [s for s in samples if "roles" in s]
    for s in samples:
        s["t"] = dt.datetime.fromisoformat(s["utc"])
    rows = ["| step | wall s | requests | role | CPU s | cores | CPU ms per request |", "|" + "---|" * 7]
    for name, t0, t1 in steps_of(out / "window.log"):
        win = [s for s in samples if t0 - dt.timedelta(seconds=5) <= s["t"] <= t1 + dt.timedelta(seconds=5)]
        if len(win) < 2:
            continue
        wall = (win[-1]["t"] - win[0]["t"]).total_seconds()
        n = sum(json.loads(p.read_text())["n_sent"] for p in (out / name).glob("*/runs/*.json")) if name in (
            "ab", "repeat") else 0
        cpu: dict[str, float] = {}
        for x, y in itertools.pairwise(win):
            for sess, procs in y["ours"].items():
                for pid, (c, _) in procs.items():
                    before = x["ours"].get(sess, {}).get(pid)
                    if before is not None and pid in y["roles"]:
                        role = _role(y["roles"], pid)
                        cpu[role] = cpu.get(role, 0.0) + max(0.0, c - before[0])
        for role, c in sorted(cpu.items()):
            if c >= 0.05:
                rows.append(f"| {name} | {wall:.0f} | {n or ''} | {role} | {c:.1f} | {c / wall:.3f} | "
                            f"{c / n * 1e3 if n else float('nan'):.1f} |")
    return "\n".join(rows)


def threads_report(out: pathlib.Path, step: str) -> str:
    """During ``step``: per vLLM process thread with at least 1% of a core, its CPU and the cores it was
    last seen on (a thread seen on both cores floats)."""
    samples = [json.loads(x) for x in (out / "sched.jsonl").read_text().splitlines() if x.strip()]
    samples = [s for s in samples if "threads" in s]
    spans = [(t0, t1) for name, t0, t1 in steps_of(out / "window.log") if name == step]
    if not spans:
        return f"(no step {step})"
    t0, t1 = spans[0]
    win = [s for s in samples if t0 <= dt.datetime.fromisoformat(s["utc"]) <= t1]
    if len(win) < 2:
        return f"(too few samples in {step})"
    wall = (dt.datetime.fromisoformat(win[-1]["utc"]) - dt.datetime.fromisoformat(win[0]["utc"])).total_seconds()
    rows = [f"| process | thread | CPU s in {step} | cores | last seen on cores |", "|---|---|---|---|---|"]
    first, last = win[0]["threads"], win[-1]["threads"]
    for pid, ths in last.items():
        role = _role(win[-1]["roles"], pid) if pid in win[-1]["roles"] else pid
        for tid, (c, _, comm) in ths.items():
            c0 = first.get(pid, {}).get(tid, [c])[0]
            seen = sorted({s["threads"].get(pid, {}).get(tid, [0, -1])[1] for s in win} - {-1})
            if (c - c0) / wall >= 0.01:
                rows.append(f"| {role} | {comm} | {c - c0:.1f} | {(c - c0) / wall:.3f} | {seen} |")
    return "\n".join(rows)


def repeat_report(out: pathlib.Path) -> str:
    """The repeated seed against its first run, per policy."""
    keys = ("latency_mean", "latency_p90", "ttft_p90", "tpot_p50", "apc_realized")
    rows = ["| policy | seed | UTC run / repeat | " + " | ".join(f"{k} run / repeat (diff)" for k in keys) + " |",
            "|" + "---|" * (3 + len(keys))]
    pairs = []
    for rep in sorted((out / "repeat" / "rate-3" / "runs").glob("*.json")):
        first = out / "ab" / "rate-3" / "runs" / rep.name
        if not first.exists():
            continue
        r0, r1 = (json.loads(p.read_text()) for p in (first, rep))
        cells = []
        for k in keys:
            if k == "apc_realized":
                cells.append(f"{r0[k] * 100:.1f} / {r1[k] * 100:.1f} ({(r1[k] - r0[k]) * 100:+.1f} pp)")
            else:
                sc = 1000.0 if k == "tpot_p50" else 1.0
                cells.append(f"{r0[k] * sc:.3f} / {r1[k] * sc:.3f} ({(r1[k] / r0[k] - 1) * 100:+.0f}%)")
        when = f"{r0.get('utc', ['?'])[0][11:19]} / {r1.get('utc', ['?'])[0][11:19]}"
        rows.append(f"| {r0['policy']} | {r0['seed']} | {when} | " + " | ".join(cells) + " |")
        pairs.append((r0, r1))
    if len(pairs) >= 2:
        from replayer.sim_vs_real import kendall

        # the same seed twice on the same engines: the ranking agreement the noise alone allows
        rows.append("")
        rows.append("- Kendall tau of the policies' ranking, run against its repeat: " + ", ".join(
            f"{k} {kendall(*[sorted(range(len(pairs)), key=lambda i, j=j: pairs[i][j][k]) for j in (0, 1)]):.2f}"
            for k in ("latency_mean", "latency_p50", "latency_p90", "ttft_p50", "ttft_p90")))
    return "\n".join(rows)


def compare_report(docs: dict[str, dict]) -> str:
    """Before/after tables of ``gpuhit experiment sim-vs-real`` on the same live folder, one column per
    labelled result (profile or ``--live-path`` model): per policy the simulated-vs-real errors of mean
    latency and TTFT p90, the APC difference and the modeled path; per label the rankings' agreement."""
    labels = list(docs)
    out = []
    first = docs[labels[0]]
    for rate in first["rates"]:
        pols = list(first["rates"][rate]["policies"])
        cols = ["mean err", "TTFT p90 err", "APC pp", "path ms"]
        out += [f"### {rate}", "", "| policy | real lat mean s (± 95% over seeds) | real TTFT p90 s (±) | real APC % | "
                "real path ms | "
                + " | ".join(f"{c} {lb}" for c in cols for lb in labels) + " |", "|" + "---|" * (5 + len(cols) * len(labels))]
        for pol in pols:
            vs = {lb: docs[lb]["rates"][rate]["policies"][pol] for lb in labels}
            v0 = vs[labels[0]]
            cells = [f"{v['rel_error']['latency_mean'] * 100:+.0f}%" for v in vs.values()]
            cells += [f"{v['rel_error']['ttft_p90'] * 100:+.0f}%" for v in vs.values()]
            cells += [f"{v['apc_diff'] * 100:+.1f}" for v in vs.values()]
            cells += [f"{v['attribution'].get('path_model_s', float('nan')) * 1e3:.0f}" for v in vs.values()]
            # an interval over one seed does not exist (null in the JSON)
            hw = {k: float("nan") if x is None else x for k, x in v0.get("real_half_width", {}).items()}
            out.append(f"| {pol} | {v0['real']['latency_mean']:.3f} ± {hw.get('latency_mean', float('nan')):.3f} | "
                       f"{v0['real']['ttft_p90']:.3f} ± {hw.get('ttft_p90', float('nan')):.3f} | "
                       f"{v0['real']['apc_realized'] * 100:.1f} | {v0['attribution'].get('path_real_s', float('nan')) * 1e3:.0f} | "
                       + " | ".join(cells) + " |")
        out.append("")
        for lb in labels:
            d = docs[lb]["rates"][rate]
            errs = [v["rel_error"]["latency_mean"] for v in d["policies"].values()]
            t90 = [v["rel_error"]["ttft_p90"] for v in d["policies"].values()]
            apc = [v["apc_diff"] for v in d["policies"].values()]
            r = d["rankings"]["latency_mean"]
            inside = {m: sum(bool(v.get("sim_in_real_interval", {}).get(m)) for v in d["policies"].values())
                      for m in ("latency_mean", "ttft_p90")}
            out.append(f"- {lb}: mean latency {min(errs) * 100:+.0f}% .. {max(errs) * 100:+.0f}% (mean |err| "
                       f"{sum(map(abs, errs)) / len(errs) * 100:.0f}%, within 10%: {sum(abs(e) <= 0.10 for e in errs)} of "
                       f"{len(errs)}); TTFT p90 within 20%: {sum(abs(e) <= 0.20 for e in t90)} of {len(t90)}; APC within "
                       f"3 pp: {sum(abs(a) <= 0.03 for a in apc)} of {len(apc)}; sim inside the real 95% interval: mean "
                       f"{inside['latency_mean']}, TTFT p90 {inside['ttft_p90']} of {len(errs)}; best by mean real {r['real'][0]} / sim "
                       f"{r['sim'][0]}; Kendall tau " + ", ".join(
                           f"{k} {d['rankings'][k]['kendall_tau']:.2f}" for k in d["rankings"])
                       + "; over the pairs the real side separates: " + ", ".join(
                           f"{k} {_sep(d['rankings'][k])}" for k in d["rankings"]))
        out.append("")
    return "\n".join(out)


def _sep(rank: dict) -> str:
    """The tau over the pairs the real side separates, with how many they are (older results lack it)."""
    sep = rank.get("separated")
    if not sep:
        return "n/a"
    tau = float("nan") if sep["tau"] is None else sep["tau"]  # NaN (no separated pair) is null in the JSON
    return f"{tau:.2f} ({sep['separated']}/{sep['pairs']})"
