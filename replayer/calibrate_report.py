"""The human-readable summary ``gpuhit profile fit`` prints of a fit (``--json`` prints the document)."""

from __future__ import annotations

import pathlib
from typing import Any


def print_fit(name: str, out: pathlib.Path, info: dict[str, Any], fit: dict[str, Any], entry: dict[str, Any],
              live_path: dict[str, Any]) -> None:
    """The profile written, its parameters, errors and check, the host's models and the live path."""
    print(f"profile {name!r} written to {out}: {info['num_gpu_blocks']} blocks of {info['block_size']}, "
          f"max_model_len {info['max_model_len']}")
    for k, v in fit["params"].items():
        print(f"  {k:24s} {v:.4g}")
    for which in ("fit_error", "held_out_error", "loo_error"):
        e = fit[which]
        print(f"  {which.replace('_', ' ')}: " + "; ".join(
            f"{k} mean {v['mean_abs_rel'] * 100:.1f}% max {v['max_abs_rel'] * 100:.1f}% (n={v['n']}"
            + (f", {v['stalled']} of {v['probes']} probes stalled" if v.get("stalled") else "") + ")"
            for k, v in e.items()))
    check = fit["check"]
    print("  fit check: " + ("ok" if check["ok"] else "FLAGGED: " + "; ".join(check["reasons"])))
    for r in entry["fit"].get("host_contention", []):
        print(f"  with {r['busy_engines']} engines busy a step takes {r['factor']:.3g}x its time alone (prefill "
              f"{r['prefill_factor']:.3g}x, decode {r['decode_factor']:.3g}x)")
    if entry.get("host_cpu"):
        h, fr = entry["host_cpu"], entry["fit"]["host_cpu"]["frontend"]
        print("  host CPU: " + "; ".join(f"{k} {c['per_request_s'] * 1e3:.2f} ms/request, {c['per_token_s'] * 1e3:.3f} "
                                        f"ms/token, idle {c['idle_cores']:.3f} cores" for k, c in fr.items())
              + f"; {h['cores']:g} cores, {h['busy_extra_cores']:.3f} more per busy engine, shares "
              + ", ".join(f"{x:.2f}" for x in h["share"]))
    if entry["fit"].get("stalls"):
        from replayer.calibrate_stalls import describe

        print("\n".join("  " + line for line in describe(entry["fit"]["stalls"])))
    print("  live path: direct client's HTTP path {:.1f} ms{}".format(
        live_path["direct_path_s"] * 1e3, "" if "gateway_ttft_s" not in live_path else
        f"; a gateway adds {live_path['gateway_ttft_s'] * 1e3:.1f} ms to TTFT, {live_path['gateway_e2e_s'] * 1e3:.1f} ms "
        f"end to end"))
    if live_path.get("by_in_flight"):
        print("  live path by requests in flight at the gateway: " + ", ".join(
            f"{r['in_flight']:.2f}: {r['path_s'] * 1e3:.1f} ms" for r in live_path["by_in_flight"]))
        print("  under that load, measured / step model: engines' mean TTFT " + ", ".join(
            f"{r['in_flight']:.2f}: {r['engine_ttft_s'] * 1e3:.0f} / {r['engine_ttft_model_s'] * 1e3:.0f} ms"
            for r in live_path["by_in_flight"]) + "; TPOT " + ", ".join(
            f"{r['tpot_s'] * 1e3:.1f} / {r['tpot_model_s'] * 1e3:.1f} ms" for r in live_path["by_in_flight"]))
        if "engine_ttft_model_s_alone" in live_path["by_in_flight"][0]:
            print("  the step model without the host's contention: engines' mean TTFT " + ", ".join(
                f"{r['engine_ttft_model_s_alone'] * 1e3:.0f}" for r in live_path["by_in_flight"]) + " ms; TPOT " + ", ".join(
                f"{r['tpot_model_s_alone'] * 1e3:.1f}" for r in live_path["by_in_flight"]) + " ms")
