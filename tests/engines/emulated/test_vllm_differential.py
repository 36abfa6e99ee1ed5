"""The emulator against vLLM's own Scheduler + KVCacheManager, step by step.

Every configuration of :data:`workload.CONFIGS` runs 200 generated streams and 3 streams cut
from real traces (two WEKA Claude Code files with their growing shared prefixes, Mooncake)
through both sides; every step must agree on everything but time (see
:mod:`engines.emulated.vllm_check`). One vLLM subprocess serves all streams. Skipped, with one
line, when the vLLM venv is absent.
"""

from __future__ import annotations

import pathlib

import pytest

from engines.emulated.vllm_check import compare, run, workload
from replayer.loaders import load_trace
from replayer.synth import TokenSynthesizer

REPO = pathlib.Path(__file__).resolve().parents[3]
N_GENERATED = 200
# per configuration: (first turn's token cap, growth per turn, output cap, pool blocks)
REAL_SIZES = {16: (160, 96, 20, 40), 128: (700, 400, 24, 20)}
SHARED_WEKA = REPO.parent / "shared" / "traces" / "weka_cc"


def _sessions_from(trace_path: pathlib.Path, n_sessions: int, n_turns: int, bs: int, cap_total: int | None):
    """The first multi-turn sessions of a trace as (prompt tokens, output length) turns, each turn cut
    to a cap that grows turn by turn (so a turn still extends the previous one)."""
    first, grow, out_cap, _ = REAL_SIZES[bs]
    trace = load_trace(trace_path).trace
    synth = TokenSynthesizer(engine_block_size=bs)
    out = []
    for s in trace.sessions:
        if len(s.turns) < 2:
            continue
        turns = []
        for k, t in enumerate(s.turns[:n_turns]):
            out_len = max(1, min(t.output_length, out_cap))
            cap = first + grow * k
            if cap_total is not None:
                cap = min(cap, cap_total - out_len)
            toks = synth.prompt_tokens(s, k)[:cap]
            turns.append((toks, out_len))
        out.append(turns)
        if len(out) == n_sessions:
            break
    return out


def _real_streams(config: str) -> list[dict]:
    cfg = workload.CONFIGS[config]
    bs = cfg["block_size"]
    cap_total = None if cfg["chunked_prefill"] else cfg["max_num_batched_tokens"]
    blocks = REAL_SIZES[bs][3]
    weka = sorted((REPO / "traces" / "weka_cc").glob("*.json.gz"))
    sources = [("weka-a", weka[0]), ("weka-b", weka[1]),
               ("mooncake", REPO / "traces" / "mooncake" / "conversation_trace.jsonl.gz")]
    if SHARED_WEKA.is_dir():  # the full slice, when this checkout has it beside it
        shared = sorted(SHARED_WEKA.glob("*.json.gz"))
        if shared:
            sources[1] = ("weka-shared", shared[0])
    return [workload.from_sessions(config, name, _sessions_from(path, 4, 4, bs, cap_total), blocks)
            for name, path in sources]


# the engine's own step loop without the jump (slower to drive) runs on the real-trace streams and
# the first generated ones; the scheduler stepped directly and the decode-jump loop run on all
N_LOOP = 40


# CPU cost ~70 s alone; the limit leaves room for a loaded machine
@pytest.mark.timeout(1200)
def test_emulator_matches_vllm_scheduler_step_by_step():
    python = run.vllm_python()
    if python is None:
        pytest.skip("no vLLM venv (set GPUHIT_VLLM_PYTHON or build .venv-vllm): differential check skipped")
    streams, loop_idx = [], []
    for config in workload.CONFIGS:
        real = _real_streams(config)
        loop_idx.extend(range(len(streams), len(streams) + len(real) + N_LOOP))
        streams.extend(real)
        streams.extend(workload.generated_streams(config, N_GENERATED))
    theirs = run.run_vllm(streams, python)
    results = run.check(streams, python, modes=("step", "jump"), theirs=theirs)
    results.update(run.check([streams[i] for i in loop_idx], python, modes=("loop",),
                             theirs=[theirs[i] for i in loop_idx]))
    print("\n" + run.format_results(results))
    for name, r in results.items():
        assert r.streams == (N_GENERATED + 3 if "[loop]" not in name else N_LOOP + 3)
        assert not r.mismatching_streams, f"{name}: {len(r.mismatching_streams)} streams differ\n{r.first_report}"
        assert r.steps > 0


# streams per priority configuration for the coverage check below (vLLM side only, run twice)
N_COVERAGE = 60


# CPU cost ~20 s alone (one vLLM subprocess; importing vLLM and torch is ~5 s of it)
@pytest.mark.timeout(600)
def test_priority_streams_exercise_what_only_the_priority_scheduler_does():
    """The priority configurations would prove little if vLLM scheduled their streams as FCFS does:
    the same streams re-run through vLLM's scheduler under FCFS must come out different in most
    of them, and most pressure streams must preempt (where the victim is chosen by priority).
    Every configuration's streams, both ways, go through one vLLM subprocess: each start imports
    vLLM (and torch) again, which cost more than the streams themselves."""
    import copy

    python = run.vllm_python()
    if python is None:
        pytest.skip("no vLLM venv (set GPUHIT_VLLM_PYTHON or build .venv-vllm): differential check skipped")
    configs = [c for c, cfg in workload.CONFIGS.items() if cfg["policy"] == "priority"]
    batch = []
    for config in configs:
        prio = list(workload.generated_streams(config, N_COVERAGE))
        fcfs = copy.deepcopy(prio)
        for w in fcfs:
            w["config"]["policy"] = "fcfs"
        batch.extend(prio + fcfs)
    records = run.run_vllm(batch, python)
    for k, config in enumerate(configs):
        theirs = records[2 * N_COVERAGE * k: 2 * N_COVERAGE * (k + 1)]
        differ = sum(compare.compare_stream(a, b)[1] is not None
                     for a, b in zip(theirs[:N_COVERAGE], theirs[N_COVERAGE:]))
        assert differ >= N_COVERAGE // 2, f"{config}: only {differ}/{N_COVERAGE} streams schedule differently from FCFS"
        if workload.CONFIGS[config].get("shape") == "pressure":
            preempting = sum(any(r["preempted"] for r in recs) for recs in theirs[:N_COVERAGE])
            assert preempting >= N_COVERAGE // 2, f"{config}: only {preempting}/{N_COVERAGE} streams preempt"
