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
