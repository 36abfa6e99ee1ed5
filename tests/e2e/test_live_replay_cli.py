"""`gpuhit replay --gateway` end to end (a real subprocess) against a gateway and two emulated vLLM
servers on loopback: cold start through the gateway's POST /reset_prefix_cache, live GPU utilization
from the engines' busy-seconds counters, and --max-requests counting rows already recorded."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys

import aiohttp

from engines.emulated.engine import EmulatedEngine
from replayer.loaders import load_trace
from replayer.synth import TokenSynthesizer
from tests.e2e.helpers import gateway, servers
from tests.e2e.test_live_replay import fast_profile

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONV = str(ROOT / "traces" / "weka_cc" / "trace_0008.json.gz")


async def _replay(url: str, out: pathlib.Path, n: int) -> tuple[int, str, dict]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "replayer.cli", "replay", "--trace", CONV, "--gateway", url, "--max-requests", str(n),
        "--time-scale", "0", "--util-interval", "0.05", "--out", str(out), "--json",
        env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    so, se = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode, se.decode(), json.loads(so) if proc.returncode == 0 else {}


def test_live_replay_starts_cold_records_utilization_and_counts_recorded_rows(tmp_path):
    async def main():
        engines = [EmulatedEngine(f"emu{i}", fast_profile(), model_name="m") for i in range(2)]
        trace = load_trace([CONV]).trace
        first = trace.sessions[0]
        async with servers(engines, model="m") as srvs, gateway(
                [f"http://127.0.0.1:{s.port}" for s in srvs], policy="lpwl") as (_gw, url), \
                aiohttp.ClientSession() as http:
            # Warm both engines with the replay's own first prompt: without the reset it would hit.
            prompt = TokenSynthesizer(seed=0).prompt_tokens(first, 0)
            for _ in range(2):
                async with http.post(url + "/v1/completions", json={"model": "m", "prompt": prompt,
                                                                    "max_tokens": 1}) as r:
                    assert r.status == 200
            out = tmp_path / "live"
            rc, err, doc = await _replay(url, out, 6)
            assert rc == 0, err
            run = doc["runs"][0]
            assert run["n_sent"] == 6 and run["n_ok"] == 6 and run["cold_start"] is True
            rows = (out / "records" / "live-seed0.csv").read_text().splitlines()
            turn0 = [r for r in rows[1:] if f",{first.session_id}," in r and r.split(",")[5] == "0"]
            assert len(turn0) == 1
            header = rows[0].split(",")
            assert int(turn0[0].split(",")[header.index("realized_hit_tokens")]) == 0  # cold: reset worked
            util = run["per_worker_util"]
            assert sorted(util) == ["e0", "e1"] and all(0 <= u <= 1 for u in util.values())
            assert sum(util.values()) > 0
            assert sorted(run["per_instance"]) == ["e0", "e1"]
            assert (out / "utilization.csv").read_text().startswith("t,engine,util\n")
            # --max-requests counts the rows already there: nothing more to send at 6, three more at 9
            rc, err, doc = await _replay(url, out, 6)
            assert rc == 0 and doc["runs"][0]["n_sent"] == 6
            rc, err, doc = await _replay(url, out, 9)
            assert rc == 0 and doc["runs"][0]["n_sent"] == 9 and "engine caches are not reset" in err
        for e in engines:
            await e.close()

    asyncio.run(main())
