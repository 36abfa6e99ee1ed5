"""Are the host's stalls one process across the host, or independent per engine and per request?

From a live A/B folder with engine spans (records with vLLM's per-request timing) and a profile
without stalls: every run is simulated again (as `gpuhit experiment sim-vs-real` does), requests are
paired with themselves, and each request's excess is its real - simulated time inside the engine
(vLLM's frontend, queue, prefill, decode) and on the path (before + after the engine). A request is
stalled in the engine when that excess is above ``--engine-ms`` (default 100) with the same prefix hit
on both sides (so that the gap is time, not work). Then, over pairs of requests of one run on the two
different engines whose engine intervals overlap (wall time on the replay clock), the lift
P(both stalled) / (P(a stalled) P(b stalled)): 1 for stalls drawn independently per engine, above 1
where one host process stalls both engines at once. The same for a request's path excess above
``--path-ms`` (default 30) against stalls of the engine requests in progress when it was sent, and a
permutation baseline (the other engine's intervals shifted by a random offset inside the run).

    python tests/perf/stall_correlation.py LIVE_AB_DIR PROFILE.json [--engine-ms 100] [--path-ms 30]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from engines.emulated.profile import load_profile
from replayer.ab_live import experiment_trace, load_runs
from replayer.gap_split import paired_parts
from replayer.live_path import delay_first_chunks, path_models
from replayer.records import answered_by_turn, read_records, records_to_frame
from replayer.sim_vs_real import complete_seeds, simulate_run

ap = argparse.ArgumentParser()
ap.add_argument("live")
ap.add_argument("profile")
ap.add_argument("--engine-ms", type=float, default=100.0)
ap.add_argument("--path-ms", type=float, default=30.0)
args = ap.parse_args()
live = pathlib.Path(args.live)
prof = load_profile(args.profile)
exp = json.loads((live / "experiment.json").read_text())
spec, eng = exp["trace"], exp["engines"]
trace = experiment_trace(spec)
ingress, lag, _ = path_models(prof, "response")
bs = int(spec["block_size"])
rng = np.random.default_rng(0)

SHIFTS = 40
cross = {"n": 0, "both": 0, "a": 0, "b": 0}
shifted = [{"n": 0, "both": 0, "a": 0, "b": 0} for _ in range(SHIFTS)]
path_rows = []
path_shifted: list[list] = [[] for _ in range(SHIFTS)]
for lr in complete_seeds(load_runs(live / "rate-3", exp["policies"], exp.get("seeds")), exp["policies"]):
    res = simulate_run(spec, eng, trace, prof, lr["policy"], int(lr["seed"]), 3.0, live_path=ingress,
                       engine_timing=True)
    if lag is not None:
        delay_first_chunks(res.records, lag, whole=True, stalls=None, seed=int(lr["seed"]))
    real = read_records(lr["records"])
    pairs = paired_parts(real, records_to_frame(res.records), bs)
    r = answered_by_turn(real).loc[pairs.index]
    eng_ex = (pairs["engine_other"] + pairs["queue"] + pairs["prefill"] + pairs["decode"]) * 1e3
    path_ex = (pairs["path_before"] + pairs["path_after"]) * 1e3
    start = r["engine_arrival"].to_numpy()
    end = start + r["engine_e2e"].to_numpy()
    inst = r["instance"].astype(str).to_numpy()
    stalled = (eng_ex.to_numpy() > args.engine_ms) & pairs["same_hit"].to_numpy()
    ok = pairs["same_hit"].to_numpy()
    span = end.max() - start.min()
    for tgt, shift in ((cross, 0.0), *((d, None) for d in shifted)):
        off = rng.uniform(0.2, 0.8) * span if shift is None else 0.0
        i0 = np.flatnonzero((inst == "gpu0") & ok)
        i1 = np.flatnonzero((inst == "gpu1") & ok)
        s1, e1 = start[i1] + off, end[i1] + off
        s1 = np.where(s1 > end.max(), s1 - span, s1)
        e1 = s1 + (end[i1] - start[i1])
        for i in i0:
            over = (start[i] < e1) & (s1 < end[i])
            for j in i1[over]:
                tgt["n"] += 1
                tgt["a"] += stalled[i]
                tgt["b"] += stalled[j]
                tgt["both"] += stalled[i] & stalled[j]
    # the path: a request sent while a stalled engine request was in progress on either engine
    arr = r["arrival"].to_numpy()
    for rows, off in ((path_rows, 0.0), *((x, rng.uniform(0.2, 0.8) * span) for x in path_shifted)):
        a = arr + off
        a = np.where(a > end.max(), a - span, a)
        for k in range(len(arr)):
            during = stalled & (start <= a[k]) & (a[k] < end)
            if off == 0.0:
                during[k] = False
            rows.append((bool(during.any()), path_ex.iloc[k] > args.path_ms))


def lift(d):
    if not d["n"]:
        return float("nan")
    pa, pb, pab = d["a"] / d["n"], d["b"] / d["n"], d["both"] / d["n"]
    return pab / (pa * pb) if pa * pb else float("nan")


print(f"engine stall: same-hit request whose in-engine time exceeds the stall-free model's by > {args.engine_ms:g} ms")
d = cross
print(f"- pairs on different engines overlapping in time: {d['n']}; P(gpu0 stalled) {d['a'] / max(d['n'], 1):.3f}, "
      f"P(gpu1 stalled) {d['b'] / max(d['n'], 1):.3f}, P(both) {d['both'] / max(d['n'], 1):.4f}; lift {lift(d):.2f}")
base = np.array([lift(x) for x in shifted])
print(f"- the same with gpu1's requests shifted in time by a random offset inside the run ({SHIFTS} shifts): lift "
      f"median {np.nanmedian(base):.2f}, 90% {np.nanquantile(base, 0.05):.2f}..{np.nanquantile(base, 0.95):.2f}; "
      f"the real lift above {np.mean(base < lift(d)) * 100:.0f}% of them")


def ratio(rows):
    p = np.array(rows, dtype=bool)
    w, wo = p[p[:, 0], 1], p[~p[:, 0], 1]
    return w.mean() / wo.mean(), w.mean(), len(w), wo.mean(), len(wo)


rt, pw, nw, pwo, nwo = ratio(path_rows)
sh = np.array([ratio(x)[0] for x in path_shifted])
print(f"- path excess > {args.path_ms:g} ms: {pw * 100:.1f}% of {nw} requests sent while an engine request was stalled, "
      f"{pwo * 100:.1f}% of {nwo} others (ratio {rt:.2f}; with the arrivals shifted in time: median "
      f"{np.nanmedian(sh):.2f}, 90% {np.nanquantile(sh, 0.05):.2f}..{np.nanquantile(sh, 0.95):.2f})")
