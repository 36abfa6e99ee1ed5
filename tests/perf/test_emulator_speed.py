"""Benchmark: one emulated engine replays one WEKA Claude Code conversation in virtual time.

Target: >= 2000x real time. Prints steps/s, simulated seconds per wall second (with the
trace's think times, and busy GPU seconds per wall second, which excludes idle time).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import pathlib
import time

import pytest

from engines.base import GenerateRequest
from engines.emulated.engine import EmulatedEngine
from gpuhit import vtime

ROOT = pathlib.Path(__file__).resolve().parents[2]
CANDIDATES = [ROOT / "traces" / "weka_cc" / "trace_0004.json.gz",
              ROOT.parent / "shared" / "traces" / "weka_cc" / "trace_0004.json.gz"]


def _load():
    for p in CANDIDATES:
        if p.exists():
            with gzip.open(p, "rt") as f:
                return p, json.load(f)
    pytest.skip("no WEKA trace_0004.json.gz (bundled traces/ or ../shared/traces/)")


def _turns(conv: dict, engine_block: int = 16):
    """Top-level turns as (prompt_len, output_len, think_s, block hashes at the engine block size)."""
    ratio = conv["block_size"] // engine_block
    out = []
    for r in conv["requests"]:
        if r.get("type") != "n":
            continue
        n_blocks = r["in"] // engine_block
        hashes = [hid * ratio + j + 1 for hid in r["hash_ids"] for j in range(ratio)][:n_blocks]
        out.append((r["in"], max(1, r["out"]), float(r.get("think_time") or 0.0), tuple(hashes)))
    return out


def test_weka_conversation_speed():
    path, conv = _load()
    turns = _turns(conv)

    async def main():
        e = EmulatedEngine("bench", "qwen3-coder-30b-a3b@h20", emit_token_ids=False)
        errors = 0
        for i, (p, o, think, hashes) in enumerate(turns):
            if i:
                await asyncio.sleep(think)
            res = await e.generate(GenerateRequest(f"t{i}", p, o, block_hashes=hashes))
            errors += not res.ok
        sim = asyncio.get_running_loop().time()
        stats = (sim, e.metrics.busy_s, e.metrics.num_steps, e.num_jumps, errors,
                 e.metrics.prefix_cache_hits / max(1, e.metrics.prefix_cache_queries))
        await e.close()
        return stats

    t0 = time.perf_counter()
    sim, busy, steps, jumps, errors, apc = vtime.run(main())
    wall = time.perf_counter() - t0
    print(f"\n{path.name}: {len(turns)} turns, {errors} rejected, APC {apc:.1%}")
    print(f"simulated {sim:.1f} s ({busy:.1f} s GPU busy) in {wall:.3f} s wall: "
          f"{sim / wall:.0f}x real time, {busy / wall:.0f}x busy time; "
          f"{steps} steps ({jumps} decode jumps), {steps / wall:.0f} steps/s")
    assert sim / wall >= 2000
