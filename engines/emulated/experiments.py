"""The *GPU-Hit-First* note's two calibration experiments (README "References"), replayed on emulated engines in virtual time.

* :func:`run_tiers` - TTFT of a request whose prefix of L tokens (8k/16k/32k/64k) is served by each
  KV tier: recompute (miss), remote store (Mooncake over the NIC), CPU DRAM (PCIe), GPU HBM.
* :func:`run_knee` - 4 concurrent closed-loop multi-turn sessions while the GPU KV capacity is swept
  from well below to well above their working set: realized APC and TTFT p90 per capacity.

Knee session shape (chosen so the per-session working set is the note's 0.91 GB): 8 turns; turn 1
prompt 2,000 tokens; each later turn's prompt is the previous prompt + 300 output tokens + 694 new
tokens (tool result), i.e. +994 tokens per turn; 300 output tokens per turn; 1.6 s think time (the
note's inter-turn gap p50). The largest context is 2,000 + 7 x 994 + 300 = 9,258 tokens x 96 KiB =
0.910 GB per session, 3.64 GB for 4 sessions. The prompt's full blocks are shared with the next
turn; generated tokens' blocks are new content to the next turn (as in a synthesized replay), so
the APC ceiling is 79.6%. Each of the 4 slots runs 3 sessions back to back (96 requests).
"""

from __future__ import annotations

import asyncio
import itertools
import math

from engines.base import GenerateRequest
from engines.emulated.engine import EmulatedEngine
from engines.emulated.profile import DEFAULT_PROFILE, Profile, load_profile
from engines.emulated.tiers import RemoteStore
from gpuhit import vtime

TIERS = ("miss", "remote", "cpu", "gpu")
TIER_LABELS = {"miss": "miss (recompute)", "remote": "remote RDMA store", "cpu": "CPU DRAM (PCIe)",
               "gpu": "GPU HBM"}
# TTFT p50 (s) from the note's hit-tier table: L -> miss, remote, cpu, gpu
SEED_TIERS: dict[int, tuple[float, float, float, float]] = {
    8000: (0.588, 0.151, 0.076, 0.053),
    16000: (1.547, 0.262, 0.105, 0.063),
    32000: (4.604, 0.680, 0.158, 0.080),
    64000: (15.23, 0.97, 0.27, 0.11),
}
# GPU KV GB -> (APC, TTFT p90 s) from the note's capacity knee
SEED_KNEE: dict[float, tuple[float, float]] = {
    1.2: (0.074, 13.0), 2.4: (0.363, 4.62), 3.6: (0.803, 0.53), 9.7: (0.729, 0.65), 14.5: (0.729, 0.65),
}
KNEE_CAPACITIES_GB = (1.0, 1.2, 1.8, 2.4, 3.0, 3.6, 4.8, 7.2, 9.7, 14.5)

KNEE_TURNS = 8
KNEE_FIRST_PROMPT = 2000
KNEE_OUTPUT = 300
KNEE_NEW_INPUT = 694
KNEE_THINK_S = 1.6
KNEE_SESSIONS_PER_SLOT = 3
KNEE_CONCURRENCY = 4


def knee_working_set_bytes(profile: Profile) -> int:
    largest = KNEE_FIRST_PROMPT + (KNEE_TURNS - 1) * (KNEE_OUTPUT + KNEE_NEW_INPUT) + KNEE_OUTPUT
    return largest * profile.kv_bytes_per_token


# ---- tiers -------------------------------------------------------------------------------------
async def _tier_ttft(profile: Profile, L: int, tier: str) -> float:
    bs = profile.block_size
    hashes = tuple(range(1, L // bs + 1))
    probe = GenerateRequest(f"probe-{tier}-{L}", L, 1, block_hashes=hashes)
    warm = GenerateRequest(f"warm-{tier}-{L}", L, 1, block_hashes=hashes)
    engines: list[EmulatedEngine] = []
    try:
        if tier == "miss":
            e = EmulatedEngine("miss", profile, emit_token_ids=False)
            engines.append(e)
        elif tier == "gpu":
            e = EmulatedEngine("gpu", profile, emit_token_ids=False)
            engines.append(e)
            await e.generate(warm)
        elif tier == "cpu":
            # a GPU pool just larger than the prefix, a filler that takes every block to push the
            # prefix out of HBM into the CPU tier, then the probe
            nblocks = L // bs + 64
            e = EmulatedEngine("cpu", profile, num_gpu_blocks=nblocks + 1,
                               cpu_offload_bytes=4 * nblocks * profile.block_bytes(), emit_token_ids=False)
            engines.append(e)
            await e.generate(warm)
            filler = tuple(range(10**9, 10**9 + nblocks))
            fres = await e.generate(GenerateRequest("filler", nblocks * bs - 1, 1, block_hashes=filler))
            if fres.error:
                raise RuntimeError(fres.error)
            assert not (e.cached_block_hashes() & set(hashes)), "filler did not evict the prefix"
        elif tier == "remote":
            store = RemoteStore(4 * (L // bs + 64))
            a = EmulatedEngine("producer", profile, remote_store=store, emit_token_ids=False)
            e = EmulatedEngine("reader", profile, remote_store=store, emit_token_ids=False)
            engines += [a, e]
            await a.generate(warm)
        else:
            raise ValueError(tier)
        res = await e.generate(probe)
        if res.error:
            raise RuntimeError(res.error)
        return res.first_token_time - res.arrival
    finally:
        for x in engines:
            await x.close()


def run_tiers(profile: str | Profile = DEFAULT_PROFILE) -> dict:
    """Every cell of the note's tier table, ours beside theirs (``diff`` = ours/seed - 1)."""
    prof = load_profile(profile) if not isinstance(profile, Profile) else profile

    async def main() -> list[dict]:
        rows = []
        for L, seed in SEED_TIERS.items():
            row: dict = {"L": L}
            for tier, s in zip(TIERS, seed):
                ours = await _tier_ttft(prof, L, tier)
                row[tier] = {"ours": ours, "seed": s, "diff": ours / s - 1}
            rows.append(row)
        return rows

    return {"profile": prof.name, "tiers": list(TIERS), "rows": vtime.run(main())}


def format_tiers(res: dict) -> str:
    head = f"{'L':>6} | " + " | ".join(f"{TIER_LABELS[t]:>26}" for t in res["tiers"])
    lines = [f"TTFT p50 (s), ours vs seed, profile {res['profile']}", head, "-" * len(head)]
    for row in res["rows"]:
        cells = []
        for t in res["tiers"]:
            c = row[t]
            cells.append(f"{c['ours']:8.3f} vs {c['seed']:6.3f} ({c['diff']:+6.1%})")
        lines.append(f"{row['L'] // 1000:>5}k | " + " | ".join(f"{x:>26}" for x in cells))
    return "\n".join(lines)


# ---- knee --------------------------------------------------------------------------------------
def _percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method)."""
    s = sorted(xs)
    if not s:
        return math.nan
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def _knee_point(profile: Profile, capacity_gb: float) -> dict:
    bs = profile.block_size
    # A small KV cache must come with a max_model_len that fits it (vLLM refuses to start
    # otherwise): the largest whole-block length, as vLLM's own startup error suggests.
    fits = (profile.num_gpu_blocks(bs, capacity_gb * 1e9) - 1) * bs
    e = EmulatedEngine("knee", profile, kv_capacity_bytes=capacity_gb * 1e9, emit_token_ids=False,
                       max_model_len=min(profile.max_model_len, fits))
    fresh = itertools.count(1)
    ttfts: list[float] = []
    hits = prompts = 0
    loop = asyncio.get_running_loop()

    async def session(slot: int, sess: int) -> None:
        nonlocal hits, prompts
        prompt = KNEE_FIRST_PROMPT
        hashes: list[int] = [next(fresh) for _ in range(prompt // bs)]
        for turn in range(KNEE_TURNS):
            req = GenerateRequest(f"s{slot}.{sess}.t{turn}", prompt, KNEE_OUTPUT, block_hashes=tuple(hashes),
                                  session_id=f"s{slot}.{sess}")
            res = await e.generate(req)
            if res.error:
                raise RuntimeError(res.error)
            ttfts.append(res.first_token_time - res.arrival)
            hits += res.cached_tokens
            prompts += prompt
            # next turn: this prompt's full blocks + output + new input (new content)
            new_prompt = prompt + KNEE_OUTPUT + KNEE_NEW_INPUT
            hashes = hashes[: prompt // bs] + [next(fresh) for _ in range(new_prompt // bs - prompt // bs)]
            prompt = new_prompt
            await asyncio.sleep(KNEE_THINK_S)

    async def slot(i: int) -> None:
        for s in range(KNEE_SESSIONS_PER_SLOT):
            await session(i, s)

    t0 = loop.time()
    await asyncio.gather(*(slot(i) for i in range(KNEE_CONCURRENCY)))
    makespan = loop.time() - t0
    m = e.metrics
    out = {
        "capacity_gb": capacity_gb,
        "apc": m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries else 0.0,
        "request_apc": hits / prompts,
        "ttft_p90": _percentile(ttfts, 0.9),
        "ttft_p50": _percentile(ttfts, 0.5),
        "preemptions": m.num_preemptions,
        "makespan_s": makespan,
        "utilization": e.utilization(),
        "requests": len(ttfts),
    }
    await e.close()
    return out


def run_knee(profile: str | Profile = DEFAULT_PROFILE,
             capacities_gb: tuple[float, ...] = KNEE_CAPACITIES_GB) -> dict:
    """APC and TTFT p90 per GPU KV capacity, beside the note's rows where it has one."""
    prof = load_profile(profile) if not isinstance(profile, Profile) else profile

    async def main() -> list[dict]:
        return [await _knee_point(prof, c) for c in capacities_gb]

    rows = vtime.run(main())
    for r in rows:
        seed = SEED_KNEE.get(r["capacity_gb"])
        r["seed_apc"], r["seed_ttft_p90"] = seed if seed else (None, None)
    ws = knee_working_set_bytes(prof)
    return {"profile": prof.name, "working_set_gb_per_session": ws / 1e9,
            "working_set_gb_total": KNEE_CONCURRENCY * ws / 1e9, "rows": rows}


def format_knee(res: dict) -> str:
    lines = [
        (f"capacity knee, profile {res['profile']}: {KNEE_CONCURRENCY} closed-loop sessions, working set "
        f"{res['working_set_gb_per_session']:.2f} GB/session = {res['working_set_gb_total']:.2f} GB"),
        (f"{'GPU KV GB':>9} | {'APC ours':>8} | {'APC seed':>8} | {'TTFT p90 ours':>13} | {'TTFT p90 seed':>13} | "
        f"{'preempt':>7} | {'makespan s':>10}"),
    ]
    lines.append("-" * len(lines[1]))
    for r in res["rows"]:
        sa = f"{r['seed_apc']:.1%}" if r["seed_apc"] is not None else "-"
        st = f"{r['seed_ttft_p90']:.2f}" if r["seed_ttft_p90"] is not None else "-"
        lines.append(f"{r['capacity_gb']:>9.1f} | {r['apc']:>8.1%} | {sa:>8} | {r['ttft_p90']:>13.2f} | {st:>13} | "
                     f"{r['preemptions']:>7} | {r['makespan_s']:>10.1f}")
    return "\n".join(lines)
