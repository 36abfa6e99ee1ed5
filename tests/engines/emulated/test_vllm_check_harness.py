"""The differential harness without vLLM: its comparator catches a difference, and the engine's own
step loop (with and without the decode jump) agrees with the directly stepped scheduler, which the
vLLM test holds to vLLM's records."""

from __future__ import annotations

import copy

import pytest

from engines.emulated.vllm_check import compare, emu_side, workload


def test_comparator_reports_the_first_difference():
    w = workload.generated("bs16-small", 1)
    ours = emu_side.run_stream(w)
    assert compare.compare_stream(ours, copy.deepcopy(ours)) == (len(ours), None)
    theirs = copy.deepcopy(ours)
    k = next(i for i, r in enumerate(theirs) if r["free_queue"][:2] and len(r["free_queue"]) > 1)
    theirs[k]["free_queue"][:2] = theirs[k]["free_queue"][1::-1]
    n, report = compare.compare_stream(theirs, ours)
    assert n == k and "free_queue differs" in report


@pytest.mark.parametrize("config", list(workload.CONFIGS))
def test_engine_loop_matches_the_stepped_scheduler(config):
    checked = 0
    for w in workload.generated_streams(config, 12):
        stepped = emu_side.run_stream(w)
        for jump in (False, True):
            try:
                recs = emu_side.run_stream_async(w, jump_decode=jump)
            except emu_side.Unaligned:
                continue
            _, report = compare.compare_boundaries(stepped, recs)
            assert report is None, f"{w['name']} jump={jump}: {report}"
            checked += 1
    assert checked >= 20
