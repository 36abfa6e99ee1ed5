"""vLLM side of the differential check: run workloads through vLLM's own ``Scheduler``.

Run with the vLLM venv's python (this file imports only vllm and the standard library, never
gpuhit)::

    python vllm_side.py IN.json OUT.json

``IN.json`` is ``{"streams": [workload, ...]}`` (format: :mod:`engines.emulated.vllm_check.workload`);
``OUT.json`` gets ``{"vllm_version": ..., "streams": [[step record, ...], ...]}``. No model runs: the
scheduler is built exactly as vLLM's ``tests/v1/core/utils.py::create_scheduler`` builds it (a
``VllmConfig`` over a local directory holding only a Llama ``config.json``, a ``KVCacheConfig`` with
one ``FullAttentionSpec`` group), each step's ``ModelRunnerOutput`` is made by hand from the
workload's output tokens, and KV events are caught where the scheduler publishes them.
Set ``PYTHONHASHSEED`` (the caller does) so NONE_HASH matches the emulator's hasher.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 32000, "max_position_embeddings": 1 << 20,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


class _Catch:
    """Stands in for the scheduler's KV event publisher: keeps the batches it is given."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def build_scheduler(cfg: dict, model_dir: str):
    import torch
    from vllm.config import CacheConfig, KVEventsConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs = cfg["block_size"]
    model_config = ModelConfig(model=model_dir, tokenizer=None, skip_tokenizer_init=True,
                               max_model_len=cfg["max_model_len"], dtype="float32", seed=0)
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], enable_chunked_prefill=cfg["chunked_prefill"],
        policy=cfg["policy"], is_encoder_decoder=False,
    )
    cache_config = CacheConfig(block_size=bs, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=cfg["prefix_caching"],
                               prefix_caching_hash_algo="sha256")
    cache_config.num_gpu_blocks = cfg["num_gpu_blocks"]
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=cfg["num_gpu_blocks"], kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            ["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.float32))],
    )
    cache_config.num_gpu_blocks = cfg["num_gpu_blocks"]
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                      structured_output_manager=StructuredOutputManager(vllm_config), block_size=bs)
    sched.kv_event_publisher = _Catch()
    # the preemption order (SchedulerOutput keeps only a set of ids)
    sched.preempt_order = []
    orig = sched._preempt_request

    def preempt(request, *args, **kwargs):
        sched.preempt_order.append(request.request_id)
        return orig(request, *args, **kwargs)

    sched._preempt_request = preempt
    # the prefix-cache lookups counted at admission, per request
    kvm = sched.kv_cache_manager
    kvm.admissions = []
    orig_record = kvm.record_prefix_cache_stats

    def record(request, num_hits):
        if kvm.log_stats and kvm.prefix_cache_lookup_enabled(request):
            kvm.admissions.append([request.request_id, request.num_tokens, num_hits, request.num_preemptions > 0])
        return orig_record(request, num_hits)

    kvm.record_prefix_cache_stats = record
    return sched


def _event(e) -> list:
    name = type(e).__name__
    if name == "BlockStored":
        return ["S", [int(h) for h in e.block_hashes],
                None if e.parent_block_hash is None else int(e.parent_block_hash), list(e.token_ids)]
    if name == "BlockRemoved":
        return ["R", [int(h) for h in e.block_hashes]]
    if name == "AllBlocksCleared":
        return ["C"]
    return ["?", name]


def run_stream(w: dict, model_dir: str, hash_fn) -> list[dict]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    cfg = w["config"]
    sched = build_scheduler(cfg, model_dir)
    catch: _Catch = sched.kv_event_publisher
    hasher = get_request_block_hasher(cfg["block_size"], hash_fn)
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    reqs: dict[str, Request] = {}
    outputs = {r["id"]: r["output"] for r in w["requests"]}
    arrivals: dict[int, list[dict]] = {}
    aborts: dict[int, list[str]] = {}
    for r in w["requests"]:
        arrivals.setdefault(r["arrival"], []).append(r)
        if r.get("abort") is not None:
            aborts.setdefault(r["abort"], []).append(r["id"])
    stats = [0, 0, 0, 0, 0, 0]
    done: set[str] = set()
    records = []
    last_step = max([r["arrival"] for r in w["requests"]] + [a for a in aborts] + [0])
    step = 0
    while step <= last_step or len(done) < len(w["requests"]):
        if step >= w.get("max_steps", 100000):
            raise RuntimeError(f"stream {w.get('name')} did not finish in {step} steps")
        ab = [rid for rid in aborts.get(step, ()) if rid in reqs and rid not in done]
        for rid in ab:
            # one call per request, in the workload's order: given several ids at once, vLLM frees
            # them in set order (arbitrary), which no emulator could follow
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            done.add(rid)
        for i, r in enumerate(arrivals.get(step, ())):
            req = Request(
                request_id=r["id"], prompt_token_ids=list(r["prompt"]),
                sampling_params=SamplingParams(max_tokens=len(r["output"]), ignore_eos=True),
                pooling_params=None, arrival_time=r["arrival_time"],
                priority=r.get("priority", 0), block_hasher=hasher,
            )
            reqs[r["id"]] = req
            sched.add_request(req)
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = reqs[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([outputs[rid][len(req.output_token_ids)]])
            else:
                sampled.append([])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        eco = sched.update_from_output(out, mro)
        finished = []
        for outs in eco.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    finished.append(o.request_id)
        done.update(finished)
        # the prefix-cache counters (update_from_output takes and resets vLLM's own each step):
        # what record_prefix_cache_stats added, summed
        for _, num_tokens, hits, preempted in kvm.admissions:
            k = 3 if preempted else 0
            stats[k] += 1
            stats[k + 1] += num_tokens
            stats[k + 2] += hits
        live = {rid: q for rid, q in reqs.items() if rid not in done}
        records.append({
            "step": step,
            "sched": [[rid, out.num_scheduled_tokens[rid]] for rid in ids],
            "preempted": list(sched.preempt_order),
            "finished": sorted(finished),
            "computed": {rid: q.num_computed_tokens for rid, q in sorted(live.items())},
            "blocks": {rid: [b.block_id for b in kvm.get_blocks(rid).blocks[0]]
                       for rid in sorted(live) if kvm.get_blocks(rid).blocks[0]},
            "events": [_event(e) for e in catch.events],
            "free": pool.get_num_free_blocks(),
            "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "stats": list(stats),
            "lookups": list(kvm.admissions),
        })
        catch.events.clear()
        sched.preempt_order.clear()
        kvm.admissions.clear()
        step += 1
    return records


def main(argv: list[str]) -> int:
    logging.disable(logging.WARNING)
    src, dst = argv[1], argv[2]
    with open(src) as f:
        job = json.load(f)
    import vllm
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        results = []
        for w in job["streams"]:
            try:
                results.append(run_stream(w, model_dir, sha256))
            except Exception as exc:  # noqa: BLE001 - reported per stream, the batch goes on
                results.append({"error": f"{type(exc).__name__}: {exc}"})
    with open(dst, "w") as f:
        # dumps, not dump: json.dump encodes in Python (the C encoder serves only one-shot dumps),
        # about 4x the CPU on these records (a step's free queue and block tables, every step)
        f.write(json.dumps({"vllm_version": vllm.__version__, "streams": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
