"""``gpuhit experiment sim-vs-real``: a live A/B experiment replayed in virtual time, side by side.

Takes a ``gpuhit experiment ab-live`` folder (its ``experiment.json``: trace, policies, seeds,
rates, the engines' count and real capacity) and a profile (``gpuhit profile fit``), runs every
(rate, policy, seed) the live experiment finished on emulated engines with that profile and the
engines' own ``num_gpu_blocks``, ``block_size`` and ``max_model_len``, and reports per policy the
simulated and real latency mean/p50/p90/p99, TTFT p50/p90, TPOT p50, APC and per-instance load,
with relative errors and the host's mean load average during the live runs (engines sharing a host
with other work run slower than any profile measured at another moment); the policy ranking on each side with Kendall's tau (scipy); one plot per
policy with both latency CDFs.

Where the two differ, requests are paired (same seed, session and turn: the same request on both
sides) to say which part of the model the gap comes from:

* **KV placement / eviction / event lag**: the share of requests whose prefix hit differs by a block
  or more, the APC difference, and the share of live requests whose hit the gateway predicted wrong
  by a block or more (KV events arriving late, or evictions after the decision);
* **step time and queueing**: the median sim/real TTFT ratio over requests with the same hit on both
  sides (same work; the residual is prefill step time, frontend/HTTP overhead and queueing);
* **decode step time**: the median sim/real TPOT ratio (both step ratios under the profile's
  ``host_contention`` where it has one: the emulated engines slow each other down as the measured
  engines did on their shared host, :mod:`engines.emulated.shared_host`);
* **typical request or tail**: the median of the paired latency gaps (real - sim) against their mean,
  and the share of the summed absolute gap that the 10% of requests furthest apart carry (a model
  right for the typical request and blind to rare stalls has a median gap near 0 and most of the
  gap in that 10%);
* **live path** (runs that read the engines' own histograms back): the client's mean TTFT minus the
  engines' (vLLM's TTFT starts when its API server receives the request) is what the replayer, the
  gateway and HTTP add; the emulated path is the profile's measured direct-client path (held by its
  frontend delay) plus the live-path model of :mod:`replayer.live_path` (``--live-path``): by default
  the lone pairs' gateway addition where a request crosses the gateway and, beyond it, the path
  ``gpuhit profile fit`` measured under load at several counts of requests in flight, as a delay of
  each request's first chunk at the count it met (never past its finish: the API server's first
  chunk leaves late while the engine keeps decoding); ``constant``: the lone pairs' gateway addition
  only; ``none``: no gateway. Their difference, as a share of the real TTFT,
  and the engine-side TTFT sim/real (the sim's TTFT less its modeled path) split the TTFT error; the
  mean in-flight count each side's requests met is reported beside them.

The component furthest from agreement is named as the main one.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gpuhit.errors import ConfigError
from replayer.gap_split import format_split, has_engine_columns, paired_parts, split_by_policy
from replayer.live_path import (
    LIVE_PATH_MODES,
    WHOLE_RESPONSE,
    delay_first_chunks,
    in_flight_at_arrival,
    path_models,
)
from replayer.rank_agreement import kendall, ranking, separated_agreement
from replayer.records import answered_by_turn, read_records, records_to_frame

METRICS = ("latency_mean", "latency_p50", "latency_p90", "latency_p99", "ttft_p50", "ttft_p90", "tpot_p50",
           "apc_realized")
# the medians too: where policies differ by less than the run-to-run spread of a tail metric, the
# typical request's ranking is the one the two sides can agree on
RANK_BY = ("latency_mean", "latency_p50", "latency_p90", "ttft_p50", "ttft_p90")
PATH_KEYS = ("ttft_real_s", "path_real_s", "path_model_s", "engine_ttft_real_s", "engine_ttft_sim_s", "in_flight_real",
             "in_flight_sim")
GAP_KEYS = ("median_gap_s", "mean_gap_s", "tail_gap_share")


def modeled_path(ingress: Any, direct_s: float, sim: Any, lag_applied: Any = ()) -> tuple[float, float]:
    """(mean modeled path, mean in-flight count at arrival) over a simulated run's answered requests:
    the direct path, plus the gateway's delay at the count each request met, plus the first-chunk
    delays :func:`replayer.live_path.delay_first_chunks` applied."""
    s = sim[sim["error"].astype(str) == ""]
    k = in_flight_at_arrival(s["arrival"].to_numpy(), s["finish"].to_numpy())
    extra = float(np.mean([ingress(int(x)) for x in k])) if ingress is not None and len(k) else 0.0
    extra += float(np.mean(lag_applied)) if len(lag_applied) else 0.0
    return direct_s + extra, float(k.mean()) if len(k) else math.nan


def path_attribution(real: Any, sim: Any, engine_side: Mapping[str, float] | None, modeled_path: float,
                     in_flight_sim: float = math.nan) -> dict[str, float]:
    """One run's TTFT split: the real live path (client mean TTFT minus the engines'), the modeled one,
    the engine-side TTFT on each side (the sim's is its TTFT less the modeled path) and the mean
    in-flight count at arrival on each side."""
    if not engine_side or not engine_side.get("n") or math.isnan(modeled_path):
        return {}
    r, s = answered_by_turn(real), answered_by_turn(sim)
    ttft_r = float((r["first_token"] - r["arrival"]).mean())
    ttft_s = float((s["first_token"] - s["arrival"]).mean())
    k_real = in_flight_at_arrival(r["arrival"].to_numpy(), r["finish"].to_numpy())
    return {"ttft_real_s": ttft_r, "path_real_s": ttft_r - float(engine_side["ttft"]), "path_model_s": modeled_path,
            "engine_ttft_real_s": float(engine_side["ttft"]), "engine_ttft_sim_s": ttft_s - modeled_path,
            "in_flight_real": float(k_real.mean()) if len(k_real) else math.nan, "in_flight_sim": in_flight_sim}


def simulate_run(spec: Mapping[str, Any], engines: Mapping[str, Any], trace: Any, profile: Any, policy: str,
                 seed: int, rate: float, live_path: Any = None, engine_timing: bool = False) -> Any:
    """One simulated run of a live experiment's (policy, seed, rate) with the engines' real capacity
    and, when given, the live path's delay at the gateway (:mod:`replayer.live_path`); ``engine_timing``:
    records with the engine's own timing, as live runs with engine spans have (:mod:`replayer.gap_split`)."""
    from replayer.simulate import simulate

    return simulate(trace, policy, instances=int(engines["count"]), profile=profile, arrival="poisson", live_path=live_path,
                    session_rate=rate, time_scale=spec.get("time_scale", 1.0), think_time_scale=spec["think_scale"],
                    max_think_time=spec["max_think"],
                    seed=seed, block_size=int(spec["block_size"]), progress=False, engine_timing=engine_timing,
                    engine_kwargs={"num_gpu_blocks": int(engines["num_gpu_blocks"]),
                                   "max_model_len": int(engines["max_model_len"])})


def _mean(runs: Sequence[Mapping[str, Any]], key: str) -> float:
    """The mean of ``key`` over the runs that report it (NaN when none does)."""
    from analysis.compare import t_interval

    return t_interval([r.get(key) for r in runs])["mean"]


def _load_share(runs: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per instance, its share of routed requests (over all seeds)."""
    tot: dict[str, float] = {}
    for r in runs:
        for name, d in r.get("per_instance", {}).items():
            tot[name] = tot.get(name, 0.0) + d["routed"]
    n = sum(tot.values())
    return {k: v / n for k, v in sorted(tot.items())} if n else {}


def attribution(real: Any, sim: Any, block_size: int) -> dict[str, float]:
    """Paired request-level comparison of one run (frames of records with the same seed)."""
    r, s = answered_by_turn(real), answered_by_turn(sim)
    both = r.merge(s, left_index=True, right_index=True, suffixes=("_r", "_s"), how="inner")
    if both.empty:
        return {"paired": 0}
    hit_diff = (both["realized_hit_tokens_r"] - both["realized_hit_tokens_s"]).abs() >= block_size
    same = both[~hit_diff]
    ttft_r = same["first_token_r"] - same["arrival_r"]
    ttft_s = same["first_token_s"] - same["arrival_s"]
    ok = (ttft_r > 0) & (ttft_s > 0)
    multi = (both["output_tokens_r"] >= 2) & (both["output_tokens_s"] >= 2)
    tpot_r = (both["finish_r"] - both["first_token_r"])[multi] / (both["output_tokens_r"][multi] - 1)
    tpot_s = (both["finish_s"] - both["first_token_s"])[multi] / (both["output_tokens_s"][multi] - 1)
    okd = (tpot_r > 0) & (tpot_s > 0)
    # The live gateway's own prediction against what the engine served: event lag and index error.
    mispredicted = (r["predicted_hit_tokens"] - r["realized_hit_tokens"]).abs() >= block_size
    gap = ((both["finish_r"] - both["arrival_r"]) - (both["finish_s"] - both["arrival_s"])).to_numpy()
    far = np.sort(np.abs(gap))[::-1]
    return {"paired": len(both), "hit_mismatch_share": float(hit_diff.mean()),
            "live_mispredicted_share": float(mispredicted.mean()),
            "median_gap_s": float(np.median(gap)), "mean_gap_s": float(gap.mean()),
            "tail_gap_share": float(far[: max(1, len(far) // 10)].sum() / far.sum()) if far.sum() > 0 else math.nan,
            "same_hit_ttft_ratio": float(np.median(ttft_s[ok] / ttft_r[ok])) if ok.any() else math.nan,
            "tpot_ratio": float(np.median(tpot_s[okd] / tpot_r[okd])) if okd.any() else math.nan}


def explain(apc_diff: float, att: Mapping[str, float]) -> str:
    """The component furthest from agreement, in words."""
    parts = {
        "KV placement / eviction / event lag": abs(att.get("hit_mismatch_share", math.nan)),
        "step time, frontend/HTTP overhead and queueing (same-hit TTFT)": abs(math.log(att["same_hit_ttft_ratio"]))
        if att.get("same_hit_ttft_ratio", 0) > 0 else math.nan,
        "decode step time (TPOT)": abs(math.log(att["tpot_ratio"])) if att.get("tpot_ratio", 0) > 0 else math.nan,
        "live path (replayer, gateway, HTTP)": abs(att["path_model_s"] - att["path_real_s"]) / att["ttft_real_s"]
        if att.get("ttft_real_s", 0) > 0 else math.nan,
    }
    known = {k: v for k, v in parts.items() if not math.isnan(v)}
    if not known:
        return "no paired requests"
    main = max(known, key=known.__getitem__)
    return (f"{main} (hit mismatch {att.get('hit_mismatch_share', math.nan) * 100:.0f}% of requests, live gateway's "
            f"hit prediction off by a block or more on {att.get('live_mispredicted_share', math.nan) * 100:.0f}%, APC "
            f"{apc_diff * 100:+.1f} pp; same-hit TTFT sim/real {att.get('same_hit_ttft_ratio', math.nan):.2f}; "
            f"TPOT sim/real {att.get('tpot_ratio', math.nan):.2f}" + (
                f"; live path real {att['path_real_s'] * 1e3:.0f} ms / modeled {att['path_model_s'] * 1e3:.0f} ms "
                f"(in flight at arrival real {att.get('in_flight_real', math.nan):.1f} / sim "
                f"{att.get('in_flight_sim', math.nan):.1f}), engine-side TTFT sim/real "
                f"{att['engine_ttft_sim_s'] / att['engine_ttft_real_s']:.2f}"
                if att.get("engine_ttft_real_s", 0) > 0 else "") + (
                f"; paired latency gap real - sim median {att['median_gap_s'] * 1e3:+.0f} ms, mean "
                f"{att['mean_gap_s'] * 1e3:+.0f} ms, {att['tail_gap_share'] * 100:.0f}% of the absolute gap in the 10% "
                "of requests furthest apart" if "median_gap_s" in att else "") + ")")


def compare_rate(live_runs: Sequence[Mapping[str, Any]], sim_runs: Sequence[Mapping[str, Any]],
                 policies: Sequence[str], attributions: Mapping[str, Sequence[Mapping[str, float]]]) -> dict[str, Any]:
    """Per policy: sim and real means over seeds, relative errors, the real side's 95% t interval over
    its seeds, loads, attribution; rankings and tau."""
    from analysis.compare import t_interval

    per_policy: dict[str, Any] = {}
    for pol in policies:
        lr = [r for r in live_runs if r["policy"] == pol]
        sr = [r for r in sim_runs if r["policy"] == pol]
        if not lr or not sr:
            continue
        real = {m: _mean(lr, m) for m in METRICS}
        # the real side's own run-to-run spread over the seeds: an error inside it is not distinguishable
        # from the noise of the live runs (NaN with one seed)
        ci = {m: t_interval([r.get(m) for r in lr]) for m in METRICS}
        sim = {m: _mean(sr, m) for m in METRICS}
        rel = {m: (sim[m] - real[m]) / real[m] if real[m] else math.nan for m in METRICS if m != "apc_realized"}
        apc_diff = sim["apc_realized"] - real["apc_realized"]
        att_runs = attributions.get(pol, [])
        att: dict[str, float] = {}
        if att_runs and sum(a.get("paired", 0) for a in att_runs):
            att = {k: _mean(att_runs, k)
                   for k in ("hit_mismatch_share", "live_mispredicted_share", "same_hit_ttft_ratio", "tpot_ratio",
                             "median_gap_s", "mean_gap_s", "tail_gap_share", *PATH_KEYS)}
            att = {k: v for k, v in att.items() if k not in (*PATH_KEYS, *GAP_KEYS) or not math.isnan(v)}
            att["paired"] = sum(a.get("paired", 0) for a in att_runs)
        loads = [x for r in lr for x in r.get("host_load", [])]
        per_policy[pol] = {"n_seeds": len(lr), "real": real, "sim": sim, "rel_error": rel, "apc_diff": apc_diff,
                           "real_half_width": {m: (c["hi"] - c["lo"]) / 2 for m, c in ci.items()},
                           "sim_in_real_interval": {m: bool(c["lo"] <= sim[m] <= c["hi"]) for m, c in ci.items()},
                           "host_load_real": float(np.mean(loads)) if loads else math.nan,
                           "load_real": _load_share(lr), "load_sim": _load_share(sr),
                           "rejected_failed_real": [sum(r["n_rejected"] for r in lr), sum(r["n_failed"] for r in lr)],
                           "rejected_failed_sim": [sum(r["n_rejected"] for r in sr), sum(r["n_failed"] for r in sr)],
                           "attribution": att, "explained_by": explain(apc_diff, att) if att else ""}
    ranks = {}
    for key in RANK_BY:
        rr = ranking({p: v["real"] for p, v in per_policy.items()}, key)
        sr_ = ranking({p: v["sim"] for p, v in per_policy.items()}, key)
        ranks[key] = {"real": rr, "sim": sr_, "kendall_tau": kendall(rr, sr_), "same_best": rr[:1] == sr_[:1],
                      "separated": separated_agreement(live_runs, {p: v["sim"][key] for p, v in per_policy.items()}, key)}
    return {"policies": per_policy, "rankings": ranks}


def format_rate(doc: Mapping[str, Any]) -> str:
    """Markdown tables of one rate's comparison."""
    lines = [("| policy | n | lat mean real / sim (err) | lat p50 | lat p90 | lat p99 | TTFT p50 | TTFT p90 | "
              "TPOT p50 ms | APC % real / sim | load real / sim | host load |"), "|" + "---|" * 12]

    def cell(v: Mapping[str, Any], m: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
        return (f"{fmt.format(v['real'][m] * scale)} / {fmt.format(v['sim'][m] * scale)} "
                f"({v['rel_error'][m] * 100:+.0f}%)")

    for pol, v in doc["policies"].items():
        load = " / ".join(",".join(f"{x * 100:.0f}" for x in d.values()) for d in (v["load_real"], v["load_sim"]))
        lines.append(f"| {pol} | {v['n_seeds']} | {cell(v, 'latency_mean')} | {cell(v, 'latency_p50')} | "
                     f"{cell(v, 'latency_p90')} | {cell(v, 'latency_p99')} | {cell(v, 'ttft_p50')} | {cell(v, 'ttft_p90')} | "
                     f"{cell(v, 'tpot_p50', 1000.0, '{:.1f}')} | {v['real']['apc_realized'] * 100:.1f} / "
                     f"{v['sim']['apc_realized'] * 100:.1f} ({v['apc_diff'] * 100:+.1f} pp) | {load} | "
                     f"{v['host_load_real']:.1f} |")
    lines.append("")
    for key, r in doc["rankings"].items():
        lines.append(f"- ranking by {key}: real {' < '.join(r['real'])}; sim {' < '.join(r['sim'])}; "
                     f"Kendall tau {r['kendall_tau']:.2f}; same best: {'yes' if r['same_best'] else 'no'}; over the "
                     f"{r['separated']['separated']} of {r['separated']['pairs']} pairs the real side separates "
                     f"(paired 95% interval excludes 0): tau {r['separated']['tau']:.2f}")
    lines.append("")
    for pol, v in doc["policies"].items():
        if v["explained_by"]:
            lines.append(f"- {pol}: largest gap from {v['explained_by']}")
    return "\n".join(lines)


def complete_seeds(runs: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> list[Mapping[str, Any]]:
    """The runs of the seeds every policy finished: a live experiment cut short mid-seed (a time-boxed
    window) leaves a seed some policies lack, which would unpair the comparison."""
    have: dict[int, set[str]] = {}
    for r in runs:
        have.setdefault(int(r["seed"]), set()).add(r["policy"])
    full = {s for s, pols in have.items() if set(policies) <= pols}
    if not full:
        raise ConfigError("no seed has a finished run of every policy")
    return [r for r in runs if int(r["seed"]) in full]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("sim-vs-real", help="replay a live A/B experiment in simulation and compare side by side",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--live", required=True, metavar="DIR", help="a `gpuhit experiment ab-live` folder")
    p.add_argument("--profile", required=True, metavar="FILE.json[#NAME]", help="the fitted profile (gpuhit profile fit)")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default DIR/sim-vs-real)")
    p.add_argument("--live-path", choices=LIVE_PATH_MODES, default="in-flight",
                   help="the live path (the profile's fit.live_path): in-flight (default: the lone pairs' gateway "
                        "addition, and the path measured under load per count of requests in flight as a delay of "
                        "each first chunk; constant where the fit has only lone pairs), response (that path as a "
                        "delay of the whole response: first chunk and finish), split (that path before the engine "
                        "and on the response, by the share the engine spans measured: fit.live_path.before_share), "
                        "constant (the gateway's addition only), none")
    p.add_argument("--repeat", default=None, metavar="DIR", help="a `gpuhit experiment ab-live` folder that "
                   "replayed some of --live's seeds again (the host's run-to-run noise, replayer/noise_floor.py); "
                   "default: DIR/../repeat where it holds the same trace")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from analysis.compare import to_json
    from engines.emulated.profile import load_profile
    from replayer.ab_live import experiment_trace, load_runs, rate_label, read_experiment
    from replayer.noise_floor import floor_of_rate, repeat_folder

    live = pathlib.Path(args.live)
    exp = read_experiment(live)
    profile = load_profile(args.profile)
    ingress, lag, path = path_models(profile, args.live_path)
    spec, engines, policies = exp["trace"], exp["engines"], exp["policies"]
    if profile.block_size != int(spec["block_size"]):
        raise ConfigError(f"the profile's block size {profile.block_size} is not the engines' {spec['block_size']}")
    trace = experiment_trace(spec)
    repeat = repeat_folder(live, spec, args.repeat)
    out = pathlib.Path(args.out) if args.out else live / "sim-vs-real"
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"live": str(live), "profile": args.profile, "live_path": path,
                              "host_contention": list(profile.host_contention),
                              "host_cpu": profile.host_cpu.to_json() if profile.host_cpu else None,
                              "stalls": profile.stalls.to_json() if profile.stalls else None,
                              "repeat": str(repeat) if repeat else None, "rates": {}}
    md = [f"# Simulated vs real: {live}", "", (f"profile `{args.profile}`; engines {engines['count']} x "
          f"{engines['num_gpu_blocks']} blocks of {engines['block_size']}, max_model_len {engines['max_model_len']}; "
          f"emulated live path: direct client {path['direct_s'] * 1e3:.1f} ms (the frontend delay) + at the gateway "
          f"{path['gateway_s'] * 1e3:.1f} ms + at the first chunk ({path['mode']}; gateway and first chunk together, "
          f"ms by requests in flight) "
          f"{', '.join(f'{k:.2f}: {v * 1e3:.1f}' for k, v in path['points']) or 'nothing'}; step time by busy engines "
          f"on the host " + (f"by its CPU demand ({profile.host_cpu})" if profile.host_cpu else
                               ', '.join(f'{i + 1}: {f:.3g}x' for i, f in enumerate(profile.host_contention)) or 'none'))
          + (f"; host stalls: steps +{profile.stalls.mean_step_excess():.1%} of their time, requests' way in "
             f"+{profile.stalls.mean_request_excess() * 1e3:.1f} ms on average" if profile.stalls else ""),
          ""]
    for rate in exp["rates"]:
        folder = live / rate_label(rate)
        if not (folder / "runs").exists():
            continue
        live_runs = complete_seeds(load_runs(folder, policies, exp.get("seeds")), policies)
        sim_runs, atts, cdf, pairs = [], {}, {}, {}
        for lr in live_runs:
            pol, seed = lr["policy"], int(lr["seed"])
            if not args.json:
                print(f"gpuhit experiment sim-vs-real: simulating {rate:g}/s {pol} seed {seed}", file=sys.stderr,
                      flush=True)
            real_df = read_records(lr["records"])
            res = simulate_run(spec, engines, trace, profile, pol, seed, rate, live_path=ingress,
                               engine_timing=has_engine_columns(real_df))
            applied = (delay_first_chunks(res.records, lag, whole=args.live_path in WHOLE_RESPONSE, stalls=profile.stalls,
                                          seed=seed) if lag is not None else ())
            sim_runs.append(res.summary())
            sim_df = records_to_frame(res.records)
            if has_engine_columns(real_df):  # the live run joined vLLM's per-request spans
                pairs.setdefault(pol, []).append(paired_parts(real_df, sim_df, int(spec["block_size"])))
            att = attribution(real_df, sim_df, int(spec["block_size"]))
            att.update(path_attribution(real_df, sim_df, lr.get("engine_side"),
                                        *modeled_path(ingress, path["direct_s"], sim_df, applied)))
            atts.setdefault(pol, []).append(att)
            for df, side in ((real_df, "real"), (sim_df, "sim")):
                ok = df[df["error"].astype(str) == ""]
                cdf.setdefault(pol, {}).setdefault(side, []).extend((ok["finish"] - ok["arrival"]).tolist())
        doc = compare_rate(live_runs, sim_runs, policies, atts)
        report["rates"][rate_label(rate)] = doc
        md += [f"## {rate:g} sessions/s", "", format_rate(doc), ""]
        doc["noise_floor"], text = floor_of_rate(live_runs, repeat, rate_label(rate), sim_runs, policies, doc)
        md += ["### The real side's own noise (replayer/noise_floor.py)", "", text, ""]
        if pairs:
            doc["gap_split"] = split_by_policy(pairs)
            md += ["### Where each request's gap was spent (engine spans)", "", format_split(doc["gap_split"]), ""]
        if not args.no_plots:
            from analysis.plots import plot_latency_cdfs

            for pol, sides in cdf.items():
                png = out / f"cdf-{rate_label(rate)}-{pol}.png"
                plot_latency_cdfs({f"{label} (n={len(sides.get(side, []))})": sides.get(side, [])
                                   for side, label in (("real", "real vLLM"), ("sim", "simulated"))}, png,
                                  title=f"{pol}: {rate:g} sessions/s, all seeds")
                md.append(f"![{pol}]({png.name})")
            md.append("")
    if not report["rates"]:
        raise ConfigError(f"{live} holds no finished live runs")
    (out / "sim-vs-real.json").write_text(to_json(report, indent=1), encoding="utf-8")
    (out / "sim-vs-real.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    if args.json:
        print(to_json({"out": str(out), **report}))
    else:
        print("\n".join(md))
        print(f"results: {out}/ (sim-vs-real.md/.json, cdf-*.png)")
    return 0
