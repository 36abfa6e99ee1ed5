"""Emulator side of the differential check: the same workloads through ``engines.emulated``.

The engine is driven one step at a time, as vLLM's engine core drives its scheduler: the step's
aborts (the engine's own abort path), its arrivals, one ``Scheduler.schedule()``, then the
engine's ``_apply`` (token bookkeeping, completions, KV events). Records are those of
:mod:`.vllm_side`, field for field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.emulated.engine import EmulatedEngine
from engines.emulated.profile import load_profile
from engines.emulated.request import FINISHED, EmuRequest, OutputChain
from engines.hashing import BlockHasher
from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

#: NONE_HASH seed on both sides (the vLLM subprocess runs with PYTHONHASHSEED set to it)
HASH_SEED = "0"


def build_engine(cfg: dict[str, Any], *, jump_decode: bool = False) -> EmulatedEngine:
    # one time unit per step: only the step count matters here
    prof = replace(load_profile("qwen3-coder-30b-a3b@h20"), step_overhead_s=1.0, per_seq_overhead_s=0.0,
                   prefill_per_token_s=0.0, prefill_attn_s=0.0, decode_per_ctx_token_s=0.0,
                   frontend_overhead_s=0.0, frontend_per_token_s=0.0)
    return EmulatedEngine(
        "emu", prof, num_gpu_blocks=cfg["num_gpu_blocks"], block_size=cfg["block_size"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"], max_num_seqs=cfg["max_num_seqs"],
        max_model_len=cfg["max_model_len"], jump_decode=jump_decode, scheduling_policy=cfg["policy"],
        enable_chunked_prefill=cfg["chunked_prefill"], enable_prefix_caching=cfg["prefix_caching"],
    )


def make_request(r: dict[str, Any], hasher: BlockHasher) -> EmuRequest:
    tokens = list(r["prompt"]) + list(r["output"])
    digests = hasher.hash_blocks(r["prompt"])
    hashes = [int.from_bytes(d[-8:], "big") for d in digests]
    req = EmuRequest(r["id"], len(r["prompt"]), len(r["output"]), hashes, tokens, r["arrival_time"], None,
                     priority=r.get("priority", 0))
    req.output_chain = OutputChain(hasher, tokens, digests[-1] if digests else None)
    return req


def event_records(events) -> list[list]:
    out: list[list] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(["S", list(e.block_hashes), e.parent_block_hash, list(e.token_ids)])
        elif isinstance(e, BlockRemoved):
            out.append(["R", list(e.block_hashes)])
        elif isinstance(e, AllBlocksCleared):
            out.append(["C"])
        else:  # pragma: no cover
            out.append(["?", type(e).__name__])
    return out


def run_stream(w: dict[str, Any]) -> list[dict[str, Any]]:
    cfg = w["config"]
    eng = build_engine(cfg)
    hasher = BlockHasher(cfg["block_size"], "sha256", seed=HASH_SEED)
    events: list = []
    eng.subscribe_kv_events(lambda batch: events.extend(batch.events))
    sched, kv, pool = eng.scheduler, eng.kv, eng.pool
    admissions: list[list] = []
    record_admission = kv.record_admission

    def record(req: EmuRequest, num_hits: int) -> None:
        if kv.enable_caching:
            admissions.append([req.request_id, req.num_tokens, num_hits, req.num_preemptions > 0])
        record_admission(req, num_hits)

    kv.record_admission = record
    arrivals: dict[int, list[dict]] = {}
    aborts: dict[int, list[str]] = {}
    for r in w["requests"]:
        arrivals.setdefault(r["arrival"], []).append(r)
        if r.get("abort") is not None:
            aborts.setdefault(r["abort"], []).append(r["id"])
    last_step = max([r["arrival"] for r in w["requests"]] + list(aborts) + [0])
    reqs: dict[str, EmuRequest] = {}
    done: set[str] = set()
    records = []
    step = 0
    while step <= last_step or len(done) < len(w["requests"]):
        if step >= w.get("max_steps", 100000):
            raise RuntimeError(f"stream {w.get('name')} did not finish in {step} steps")
        t = float(step)
        ab = [reqs[rid] for rid in aborts.get(step, ()) if rid in reqs and rid not in done]
        if ab:
            for req in ab:
                req.aborted = True
            eng._pending_aborts.extend(ab)
            eng._process_aborts(t)
            done.update(req.request_id for req in ab)
        for r in arrivals.get(step, ()):
            req = make_request(r, hasher)
            req.queued_time = t
            reqs[req.request_id] = req
            eng._requests[req.request_id] = req
            sched.add(req)
        out = sched.schedule()
        sched_rec = [[r.request_id, n] for r, n in zip(out.reqs, out.num_tokens)]
        if not out.empty:
            eng._apply(out, t, t + 1.0)
        finished = sorted(rid for rid, q in reqs.items() if q.status == FINISHED and rid not in done)
        done.update(finished)
        live = {rid: q for rid, q in reqs.items() if rid not in done}
        s = kv.stats
        records.append({
            "step": step,
            "sched": sched_rec,
            "preempted": [r.request_id for r in out.preempted],
            "finished": finished,
            "computed": {rid: q.num_computed_tokens for rid, q in sorted(live.items())},
            "blocks": {rid: kv.block_ids(q) for rid, q in sorted(live.items()) if kv.block_ids(q)},
            "events": event_records(events),
            "free": pool.num_free(),
            "free_queue": pool.free_queue.block_ids(),
            "stats": [s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries, s.preempted_hits],
            "lookups": list(admissions),
        })
        events.clear()
        admissions.clear()
        step += 1
    return records


# ---- the engine's own step loop, with or without the decode jump --------------------------------
class Unaligned(Exception):
    """The engine stepped twice at one instant (a step that only preempted takes no time), so its
    step boundaries no longer fall on the workload's step grid; only end counters compare."""


def run_stream_async(w: dict[str, Any], *, jump_decode: bool) -> list[dict[str, Any]]:
    """Run the stream through the engine's own asyncio step loop on the virtual clock (each step
    lasts exactly 1), the decode jump on or off. Records are made at every step boundary the
    engine exposes: after each step, or after a jump's merged steps (``"merged"``: how many).
    Step ``s``'s arrivals and aborts are handed in at time ``s - 0.5`` (mid-step, so they are
    seen at the next step, ``s``), or at ``s`` when the engine is idle (it then starts at ``s``)."""
    from gpuhit import vtime

    return vtime.run(_run_async(w, jump_decode))


async def _run_async(w: dict[str, Any], jump_decode: bool) -> list[dict[str, Any]]:
    import asyncio

    loop = asyncio.get_running_loop()
    cfg = w["config"]
    eng = build_engine(cfg, jump_decode=jump_decode)
    hasher = BlockHasher(cfg["block_size"], "sha256", seed=HASH_SEED)
    events: list = []
    eng.subscribe_kv_events(lambda batch: events.extend(batch.events))
    sched, kv, pool = eng.scheduler, eng.kv, eng.pool
    n_req = len(w["requests"])
    reqs: dict[str, EmuRequest] = {}
    done: set[str] = set()
    records: list[dict[str, Any]] = []
    last_sched = [-1.0]
    state = {"merged": 1, "sched": [], "preempted": []}
    arrival_step = {r["id"]: r["arrival"] for r in w["requests"]}
    unaligned: list[float] = []

    schedule = sched.schedule

    def wrapped_schedule():
        t = loop.time()
        if t == last_sched[0] or t != round(t):
            unaligned.append(t)  # raised once the run is over (the engine's loop must not see it)
        last_sched[0] = t
        out = schedule()
        state["sched"] = [[r.request_id, n] for r, n in zip(out.reqs, out.num_tokens)]
        state["preempted"] = [r.request_id for r in out.preempted]
        return out

    sched.schedule = wrapped_schedule

    def snapshot(step: int, merged: int) -> None:
        now_done = [rid for rid, q in reqs.items() if q.status == FINISHED and rid not in done]
        # completed, not aborted (an abort handed in for the next step may meet a request that
        # completes in this one: the engine then ignores it, as vLLM does)
        finished = sorted(rid for rid in now_done if reqs[rid].num_output_tokens >= reqs[rid].max_tokens)
        done.update(now_done)
        # requests handed in for the next step are not there yet in vLLM's record of this one
        live = {rid: q for rid, q in reqs.items() if rid not in done and arrival_step[rid] <= step}
        s = kv.stats
        records.append({
            "step": step, "merged": merged, "sched": state["sched"], "preempted": state["preempted"],
            "finished": finished,
            "computed": {rid: q.num_computed_tokens for rid, q in sorted(live.items())},
            "blocks": {rid: kv.block_ids(q) for rid, q in sorted(live.items()) if kv.block_ids(q)},
            "events": event_records(events), "free": pool.num_free(), "free_queue": pool.free_queue.block_ids(),
            "stats": [s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries, s.preempted_hits],
        })
        events.clear()

    apply, apply_jump = eng._apply, eng._apply_jump

    def wrapped_apply(out, start, end):
        apply(out, start, end)
        snapshot(round(start), 1)

    def wrapped_apply_jump(rs, m, ends, start, allocs):
        apply_jump(rs, m, ends, start, allocs)
        state["sched"] = [[r.request_id, 1] for r in rs]
        snapshot(round(ends[m - 1]) - 1, m)

    eng._apply, eng._apply_jump = wrapped_apply, wrapped_apply_jump
    by_step: dict[int, tuple[list[dict], list[str]]] = {}
    for r in w["requests"]:
        by_step.setdefault(r["arrival"], ([], []))[0].append(r)
        if r.get("abort") is not None:
            by_step.setdefault(r["abort"], ([], []))[1].append(r["id"])

    def hand_in(step: int, exact: bool) -> None:
        if not exact and not eng._requests:
            loop.call_at(float(step), hand_in, step, True)  # idle: it starts the step itself
            return
        arrivals, aborts = by_step[step]
        for rid in aborts:
            if rid in reqs and reqs[rid].status != FINISHED:
                eng.abort(rid)
        for r in arrivals:
            req = make_request(r, hasher)
            reqs[req.request_id] = req
            eng._requests[req.request_id] = req
            eng._enqueue(req)

    for step in sorted(by_step):
        loop.call_at(step - 0.5, hand_in, step, False)
    await eng.start()
    last = max(by_step)
    # an Unaligned raised in the step loop fails every request (the engine's guard); surface it
    while loop.time() <= last or len(reqs) < n_req or any(q.status != FINISHED for q in reqs.values()):
        await asyncio.sleep(0.25)
        if eng.last_error is not None:
            raise eng.last_error
        if loop.time() > w.get("max_steps", 100000):
            raise RuntimeError(f"stream {w.get('name')} did not finish")
    await eng.close()
    if unaligned:
        raise Unaligned(f"steps at t={unaligned[:3]}")
    return records
