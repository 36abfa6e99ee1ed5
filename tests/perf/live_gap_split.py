"""Where the paired latency gap (real - simulated) of a live A/B folder sits, per policy: the typical
request (median gap) against the mean, the requests whose prefix hit differs between the two sides,
and the requests with the same hit that took over 100 ms longer live (stalls a per-step model cannot
make). Simulates every (policy, seed) of the folder's complete seeds again, as `gpuhit experiment
sim-vs-real` does, and pairs the requests by session and turn.

    python tests/perf/live_gap_split.py LIVE_AB_DIR PROFILE.json [response|in-flight|constant|none]
"""
import json
import pathlib
import sys

import pandas as pd

from engines.emulated.profile import load_profile
from replayer.ab_live import experiment_trace, load_runs
from replayer.live_path import delay_first_chunks, path_models
from replayer.records import answered_by_turn, read_records, records_to_frame
from replayer.sim_vs_real import complete_seeds, simulate_run

live = pathlib.Path(sys.argv[1]); prof = load_profile(sys.argv[2]); mode = sys.argv[3] if len(sys.argv) > 3 else "response"
exp = json.loads((live/"experiment.json").read_text()); spec, eng = exp["trace"], exp["engines"]
trace = experiment_trace(spec); ingress, lag, _ = path_models(prof, mode)


keyed = answered_by_turn


rows = []
for lr in complete_seeds(load_runs(live/"rate-3", exp["policies"], exp.get("seeds")), exp["policies"]):
    res = simulate_run(spec, eng, trace, prof, lr["policy"], int(lr["seed"]), 3.0, live_path=ingress)
    if lag is not None:
        delay_first_chunks(res.records, lag, whole=mode == "response", stalls=prof.stalls, seed=int(lr["seed"]))
    r, s = keyed(read_records(lr["records"])), keyed(records_to_frame(res.records))
    b = r.merge(s, left_index=True, right_index=True, suffixes=("_r", "_s"))
    b["gap"] = (b.finish_r - b.arrival_r) - (b.finish_s - b.arrival_s)
    b["hitdiff"] = b.realized_hit_tokens_r - b.realized_hit_tokens_s
    b["pol"] = lr["policy"]
    rows.append(b)
d = pd.concat(rows)
print("| policy | requests | mean gap ms | median gap ms | hit differs (>= 1 block) % of requests | their share of the summed gap | real hit lower / higher | gap > 100 ms with the same hit: % of requests, share of the summed gap |")
print("|---|---|---|---|---|---|---|---|")
for pol, g in list(d.groupby("pol", sort=False)) + [("all", d)]:
    tot = g.gap.sum()
    mis = g[g.hitdiff.abs() >= 32]
    stall = g[(g.hitdiff.abs() < 32) & (g.gap > 0.1)]
    print(f"| {pol} | {len(g)} | {g.gap.mean()*1e3:+.0f} | {g.gap.median()*1e3:+.0f} | {len(mis)/len(g)*100:.0f} | {mis.gap.sum()/tot*100:.0f}% | "
          f"{(mis.hitdiff < 0).sum()} / {(mis.hitdiff > 0).sum()} | {len(stall)/len(g)*100:.0f}%, {stall.gap.sum()/tot*100:.0f}% |")
