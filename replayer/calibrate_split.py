"""``gpuhit profile path-split``: where the live path lies, before the engine or after it, from the
engine spans of live runs, written into a profile for ``--live-path split``.

Why a measurement and not a constant: the live path (client, gateway, HTTP, vLLM's API server
before it stamps the request) is measured by ``gpuhit profile fit`` as the client's TTFT less vLLM's
own, which holds both the way in and the first chunk's way back: the fit cannot tell them apart.
The engine's per-request span can: it puts the engine's arrival and end on the replay clock
(:mod:`replayer.engine_spans`), so each live request's path splits into ``path_before`` and
``path_after`` (:func:`replayer.gap_split.request_parts`). Where the path is spent matters to the
simulator: time on the way in delays the engine's view of the request (its batch, its queue, the
gateway's in-flight count), time on the way back only the client's. This command reads a live
folder run with engine spans (``gpuhit experiment ab-live --engine-spans``) and writes the share of
the path before the engine as ``fit.live_path.before_share`` (with where it came from in
``fit.live_path.before_share_from``), the rest of the profile unchanged.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from gpuhit.errors import ConfigError


def register_split(sub: Any) -> None:
    p = sub.add_parser("path-split", help="write the share of the live path before the engine, measured from "
                       "engine spans, into a profile (for --live-path split)",
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("profile", metavar="PROFILE.json[#NAME]", help="the profile file (and name) to set it in")
    p.add_argument("--live", required=True, metavar="DIR",
                   help="a `gpuhit experiment ab-live` folder whose runs joined their engine spans")
    p.add_argument("--out", default=None, metavar="PROFILE.json", help="file to write (default: the profile file)")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(func=main)


def span_frames(live: pathlib.Path) -> list[Any]:
    """The records of every finished run of a live folder, each with its engine timing (a ConfigError
    where the folder is not one, or a run has no engine columns: it ran without engine spans)."""
    from replayer.ab_live import load_runs, rate_label, read_experiment
    from replayer.gap_split import has_engine_columns
    from replayer.records import read_records

    exp = read_experiment(live)
    frames = []
    for rate in exp["rates"]:
        folder = live / rate_label(rate)
        if (folder / "runs").exists():
            for run in load_runs(folder, exp["policies"]):
                df = read_records(run["records"])
                if not has_engine_columns(df):
                    raise ConfigError(f"{run['records']} has no engine timing: its experiment ran without engine spans")
                frames.append(df)
    if not frames:
        raise ConfigError(f"{live} holds no finished live runs")
    return frames


def main(args: argparse.Namespace) -> int:
    from engines.emulated.profile import load_profile
    from replayer.gap_split import before_share

    live = pathlib.Path(args.live)
    split = before_share(span_frames(live))
    src, _, name = str(args.profile).partition("#")
    name = name or load_profile(args.profile).name  # the loader's choice: the first profile of the file
    doc = json.loads(pathlib.Path(src).read_text(encoding="utf-8"))
    lp = doc["profiles"][name].setdefault("fit", {}).setdefault("live_path", {})
    lp["before_share"] = split["before_share"]
    lp["before_share_from"] = {"live": str(live), **{k: v for k, v in split.items() if k != "before_share"}}
    out = pathlib.Path(args.out or src)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    load_profile(f"{out}#{name}")  # what was written reads back
    if getattr(args, "json", False):
        print(json.dumps({"profile": f"{out}#{name}", "live": str(live), **split}))
        return 0
    print(f"{out}#{name}: the live path {split['path_before_s'] * 1e3:.1f} ms before the engine and "
          f"{split['path_after_s'] * 1e3:.1f} ms after it over {split['n']} requests of {live}: before_share "
          f"{split['before_share']:.3f}")
    return 0
