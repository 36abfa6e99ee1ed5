"""engines.emulated.profile_fit: the fit recovers known step costs and writes a loadable profile."""

from __future__ import annotations

import json
import math

import pytest

from engines.emulated.profile import load_profile
from engines.emulated.profile_fit import (
    PARAMS,
    DecodeProbe,
    PrefillProbe,
    chunks,
    fit_profile,
    leave_one_out_error,
    median_of_repeats,
    predict_prefill,
    predict_step,
    profile_entry,
)
from gpuhit.errors import ConfigError

TRUE = {"step_overhead_s": 0.004, "per_seq_overhead_s": 0.0008, "prefill_per_token_s": 7e-5,
        "prefill_attn_s": 2e-8, "decode_per_ctx_token_s": 3e-7, "prefill_chunk_overhead_s": 0.002,
        "frontend_overhead_s": 0.003, "frontend_per_token_s": 2e-6}
MAX_BATCHED = 2048


def synthetic() -> tuple[list[PrefillProbe], list[DecodeProbe]]:
    prefill, decode = [], []
    for new, ctx in [(32, 0), (100, 0), (400, 0), (900, 0), (2000, 0), (3000, 0), (100, 512), (900, 512),
                     (100, 1024), (900, 1024), (64, 1536), (400, 1536)]:
        p = PrefillProbe(new, ctx, 0.0, 0.0, 0.0)
        engine = predict_prefill(TRUE, p, MAX_BATCHED)
        front = TRUE["frontend_overhead_s"] + TRUE["frontend_per_token_s"] * (new + ctx)
        prefill.append(PrefillProbe(new, ctx, engine, 0.001, engine + front))  # queue time is within front
    for b in (1, 4, 8):
        for ctx in (64, 900):
            d = DecodeProbe(b, ctx, 32, 0.0)
            decode.append(DecodeProbe(b, ctx, 32, predict_step(TRUE, d)))
    return prefill, decode


def test_fit_recovers_known_costs_and_predicts_held_out_probes():
    prefill, decode = synthetic()
    fit = fit_profile(prefill, decode, max_batched=MAX_BATCHED, hold_out_every=4)
    for k in (*PARAMS, "frontend_overhead_s", "frontend_per_token_s"):
        assert fit["params"][k] == pytest.approx(TRUE[k], rel=1e-3, abs=1e-12), k
    for which in ("fit_error", "held_out_error"):
        for kind in ("prefill", "ttft", "decode_step"):
            assert fit[which][kind]["n"] > 0 and fit[which][kind]["max_abs_rel"] < 1e-3
    assert fit["probes"]["prefill_held_out"] == 3 and fit["probes"]["decode_held_out"] == 2
    for kind in ("prefill", "ttft", "decode_step"):
        assert fit["loo_error"][kind]["n"] > 0 and fit["loo_error"][kind]["max_abs_rel"] < 1e-3


def test_a_prefill_chunk_costs_more_than_a_decoding_sequence_and_the_smaller_model_misses_it():
    """Decode probes pin the step overhead, so the fit tells a prefill's own fixed cost from it; the
    five-term model (no chunk overhead), fitted to the same probes, errs on short prefills."""
    prefill, decode = synthetic()
    small = tuple(k for k in PARAMS if k != "prefill_chunk_overhead_s")
    loo_small = leave_one_out_error(prefill, decode, MAX_BATCHED, small)
    loo_full = leave_one_out_error(prefill, decode, MAX_BATCHED)
    assert fit_profile(prefill, decode, max_batched=MAX_BATCHED, params=small)["params"]["prefill_chunk_overhead_s"] == 0
    assert loo_full["prefill"]["max_abs_rel"] < 1e-3 < loo_small["prefill"]["max_abs_rel"]


def test_chunked_prefill_counts_one_step_overhead_per_chunk():
    assert [chunks(n, 2048) for n in (1, 2048, 2049, 6000)] == [1, 1, 2, 3]


def test_profile_entry_has_the_engines_capacity_and_loads(tmp_path):
    prefill, decode = synthetic()
    fit = fit_profile(prefill, decode, max_batched=MAX_BATCHED)
    entry = profile_entry(fit, model="m", gpu="cpu", num_gpu_blocks=256, block_size=32, max_model_len=2048,
                          max_num_batched_tokens=MAX_BATCHED, max_num_seqs=128, kv_bytes_per_token=None,
                          sources=["test"])
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"profiles": {"fitted": entry}}))
    prof = load_profile(f"{path}#fitted")
    assert prof.num_gpu_blocks() == 256 and prof.block_size == 32 and prof.max_model_len == 2048
    assert any("kv_bytes_per_token unknown" in a for a in prof.assumptions)
    assert math.isclose(prof.prefill_per_token_s, TRUE["prefill_per_token_s"], rel_tol=1e-3)


def test_too_few_probes_is_a_clear_error():
    prefill, decode = synthetic()
    with pytest.raises(ConfigError, match="at least 3 prefill and 2 decode"):
        fit_profile(prefill[:3], decode[:2], max_batched=MAX_BATCHED)


def test_repeats_collapse_to_their_median_so_one_delayed_probe_does_not_move_the_fit():
    a = PrefillProbe(100, 0, 0.010, 0.001, 0.020)
    slow = PrefillProbe(100, 0, 0.090, 0.001, 0.200)  # the host was busy
    pre, dec = median_of_repeats([a, slow, a, PrefillProbe(200, 0, 0.02, 0.0, 0.03)],
                                 [DecodeProbe(2, 64, 8, 0.005), DecodeProbe(2, 64, 8, 0.007), DecodeProbe(2, 64, 8, 0.5)])
    assert pre == [a, PrefillProbe(200, 0, 0.02, 0.0, 0.03)] and dec == [DecodeProbe(2, 64, 8, 0.007)]


def _stalled(prefill: list[PrefillProbe], decode: list[DecodeProbe]) -> tuple[list[PrefillProbe], list[DecodeProbe]]:
    """Two passes of the clean probes; in the second, a few probes met a host stall (a process
    preempted for tens to hundreds of ms): two TTFTs, one engine prefill and one decode step."""
    second = list(prefill)
    for i, extra in ((0, 0.45), (6, 0.80)):
        p = second[i]
        second[i] = PrefillProbe(p.new, p.context, p.prefill_s, p.queue_s, p.ttft_s + extra)
    p = second[3]
    second[3] = PrefillProbe(p.new, p.context, p.prefill_s * 3, p.queue_s, p.ttft_s + 2 * p.prefill_s)
    dec2 = list(decode)
    d = dec2[1]
    dec2[1] = DecodeProbe(d.batch, d.context, d.tokens, d.step_s * 2.5)
    return prefill + second, decode + dec2


def test_a_few_stalled_probes_do_not_move_the_robust_fit():
    """The same probes twice, four of them stalled: the robust fit lands within a few % of the clean
    one on every parameter that matters for a step (least squares on two repeats' medians does not:
    the median of two is their mean), and the stalls are counted, not scored."""
    clean = fit_profile(*synthetic(), max_batched=MAX_BATCHED)
    prefill, decode = _stalled(*synthetic())
    robust = fit_profile(prefill, decode, max_batched=MAX_BATCHED)
    lsq = fit_profile(prefill, decode, max_batched=MAX_BATCHED, robust=False)
    for k in ("step_overhead_s", "per_seq_overhead_s", "prefill_per_token_s", "frontend_overhead_s"):
        assert robust["params"][k] == pytest.approx(clean["params"][k], rel=0.03), k
    assert lsq["params"]["frontend_overhead_s"] > 10 * clean["params"]["frontend_overhead_s"]
    stalled = sum(robust[w][k]["stalled"] for w in ("fit_error", "held_out_error") for k in ("ttft", "decode_step"))
    assert stalled >= 3
    assert robust["check"]["ok"] and robust["fit_error"]["ttft"]["mean_abs_rel"] < 0.03
    assert not lsq["check"]["ok"] and any("ttft" in r for r in lsq["check"]["reasons"])


def test_the_check_flags_a_fit_whose_held_out_error_is_far_above_its_fit_error():
    from engines.emulated.profile_fit import fit_check

    def err(m: float) -> dict:
        return {"n": 4, "mean_abs_rel": m, "max_abs_rel": m, "stalled": 0, "probes": 8}

    good = {"fit_error": {"prefill": err(0.05)}, "held_out_error": {"prefill": err(0.08)}}
    far = {"fit_error": {"prefill": err(0.05)}, "held_out_error": {"prefill": err(0.30)}}
    assert fit_check(good)["ok"]
    assert not fit_check(far)["ok"] and "far above" in fit_check(far)["reasons"][0]
    many = {"fit_error": {"ttft": {**err(0.05), "stalled": 5, "probes": 8}}}
    assert not fit_check(many)["ok"] and "stalled" in fit_check(many)["reasons"][0]
