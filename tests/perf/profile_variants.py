"""Variants of a fitted profile from its own stored probes, for comparing models on one live window.

    python tests/perf/profile_variants.py W/profile.json    # writes W/profile-{lsq,robust,stalls}.json

* ``lsq``: the step and frontend parameters as least squares on the shapes' medians gives them (the
  fit before it was made robust), no stalls: the previous model;
* ``robust``: the robust fit's parameters (every repeat a row, soft-L1 then Cauchy), no stalls;
* ``stalls``: the robust parameters and the stall model of the fit's stall probe
  (``fit.measurements.stall_load``), recomputed against those parameters.

Everything else (capacity, ``host_cpu``, ``host_contention``, the live path) is the profile's own:
none of it depends on the step parameters. The fit's errors and check are recomputed for each.
"""

from __future__ import annotations

import json
import pathlib
import sys


def variants(path: pathlib.Path) -> dict[str, pathlib.Path]:
    from analysis.compare import to_json
    from engines.emulated.profile_fit import DecodeProbe, PrefillProbe, fit_profile
    from replayer.calibrate_stalls import stall_tail

    doc = json.loads(path.read_text())
    (name, entry), = doc["profiles"].items()
    m = entry["fit"]["measurements"]
    pre = [PrefillProbe(**{k: (float("nan") if v is None else v) for k, v in p.items()}) for p in m["prefill"]]
    dec = [DecodeProbe(**d) for d in m["decode"]]
    out = {}
    for label, robust, stalls in (("lsq", False, False), ("robust", True, False), ("stalls", True, True)):
        fit = fit_profile(pre, dec, max_batched=int(entry["max_num_batched_tokens"]), robust=robust)
        e = json.loads(json.dumps(entry))
        e.update({k: float(f"{v:.4g}") for k, v in fit["params"].items()})
        e["fit"].update({k: fit[k] for k in ("fit_error", "held_out_error", "loo_error", "check", "robust")})
        e.pop("stalls", None)
        e["fit"].pop("stalls", None)
        if stalls:
            if not m.get("stall_load"):
                raise SystemExit(f"{path}: the fit has no stall probe (gpuhit profile fit --stall-requests)")
            cores = float((entry.get("host_cpu") or {}).get("engine_cores", 1.0))
            e["fit"]["stalls"] = tail = stall_tail(m["stall_load"], fit["params"], int(entry["max_num_batched_tokens"]),
                                                   cores)
            e["stalls"] = tail["stalls"]
        dst = path.with_name(f"{path.stem}-{label}.json")
        dst.write_text(to_json({"profiles": {name: e}}, indent=1))
        out[label] = dst
        print(f"{dst}: frontend {fit['params']['frontend_overhead_s'] * 1e3:.1f} ms, ttft fit error "
              f"{fit['fit_error']['ttft']['mean_abs_rel']:.1%}, check {'ok' if fit['check']['ok'] else fit['check']['reasons']}"
              + (f", stalls {e['stalls']['step_rate_per_s']:.2f}/s steps, {e['stalls']['request_p']:.0%} of requests"
                 if stalls else ""))
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        variants(pathlib.Path(p))
