"""The stall probe's reduction (``replayer.calibrate_stalls.stall_tail``): each request split into its
parts, the excess of each over its typical value, where the stalled excess lies and the emulator's
``stalls`` model from it. Synthetic raw loads in the shape ``measure_stall_load`` records them."""

from __future__ import annotations

import pytest

from engines.emulated.profile_fit import PrefillProbe, predict_prefill
from engines.emulated.stalls import Stalls
from replayer.calibrate_stalls import PARTS, stall_tail

PARAMS = {"step_overhead_s": 0.004, "per_seq_overhead_s": 0.0005, "prefill_per_token_s": 7e-5, "prefill_attn_s": 2e-8,
          "decode_per_ctx_token_s": 6e-7, "prefill_chunk_overhead_s": 0.002, "frontend_overhead_s": 0.006,
          "frontend_per_token_s": 0.0}
LE = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, float("inf")]
TOKENS = 16


def _load(prefill_stall: dict[int, float], path_stall: dict[int, float], decode_stall: dict[int, float], n: int = 40,
          front_stall: dict[int, float] | None = None):
    reqs = []
    for i in range(n):
        size = 300 + 37 * i
        pre = 1.25 * predict_prefill(PARAMS, PrefillProbe(size, 0, 0.0, 0.0, 0.0), 2048) + prefill_stall.get(i, 0.0)
        step = 0.008
        dec = step * (TOKENS - 1) + decode_stall.get(i, 0.0)
        itl = [0.0] * len(LE)
        itl[0] = TOKENS - 1 - (1 if i in decode_stall else 0)
        if i in decode_stall:
            itl[6] = 1  # one gap in (0.15, 0.2]
        front, path = 0.004 + (front_stall or {}).get(i, 0.0), 0.003 + path_stall.get(i, 0.0)
        e_ttft = 0.0001 + pre + front
        reqs.append({"engine": i % 2, "size": size, "cached": 0, "ttft_s": e_ttft + path,
                     "e2e_s": e_ttft + path + dec + 0.001,
                     "engine_s": {"ttft": e_ttft, "queue": 0.0001, "prefill": pre, "decode": dec, "e2e": e_ttft + dec},
                     "itl": itl})
    return {"output_tokens": TOKENS, "itl_le": LE, "requests": reqs}


def test_stalls_in_prefill_steps_are_found_there_and_modeled_per_second_of_step_time():
    load = _load({3: 0.2, 11: 0.3, 25: 0.15}, {}, {})
    tail = stall_tail(load, PARAMS, 2048)
    assert set(tail["parts"]) == set(PARTS) and tail["requests"] == 40
    assert tail["where"] == "prefill_step" and tail["engine_steps_share"] == pytest.approx(1.0)
    pre = tail["parts"]["prefill_step"]
    assert pre["stalled"] == pytest.approx(3 / 40) and pre["over_100ms"] == pytest.approx(3 / 40)
    model = Stalls(**{k: tuple(v) if isinstance(v, list) else v for k, v in tail["stalls"].items()})
    assert sorted(model.step_lengths_s) == pytest.approx([0.15, 0.2, 0.3])
    # three stalls over the typical step time met (the prefills at the typical contention, the decode steps)
    assert model.step_rate_per_s == pytest.approx(3 / tail["step_time_s"])
    assert model.request_p == 0 and not model.request_lengths_s


def test_stalls_on_the_path_in_vllms_frontend_and_in_decode_steps_split_as_measured():
    load = _load({}, {5: 0.4, 9: 0.1}, {7: 0.17}, front_stall={12: 0.06})
    tail = stall_tail(load, PARAMS, 2048)
    assert tail["where"] == "path_in"
    assert tail["parts"]["path_in"]["stall_share"] == pytest.approx(0.5 / 0.73, rel=1e-3)
    assert tail["parts"]["decode_steps"]["stall_share"] == pytest.approx(0.17 / 0.73, rel=1e-3)
    assert tail["parts"]["engine_frontend"]["stall_share"] == pytest.approx(0.06 / 0.73, rel=1e-3)
    s = tail["stalls"]
    assert s["path_p"] == pytest.approx(2 / 40) and sorted(s["path_lengths_s"]) == pytest.approx([0.1, 0.4])
    assert s["request_p"] == pytest.approx(1 / 40) and s["request_lengths_s"] == pytest.approx([0.06])
    assert s["step_lengths_s"] == pytest.approx([0.17])  # one slow gap in vLLM's histogram: one stalled step


def test_steps_on_an_accelerator_get_no_step_stalls():
    tail = stall_tail(_load({3: 0.2}, {5: 0.4}, {}), PARAMS, 2048, engine_cores=0)
    assert tail["stalls"]["step_rate_per_s"] == 0 and tail["stalls"]["step_lengths_s"] == []
    assert tail["stalls"]["path_p"] > 0 and tail["steps_on_accelerator"]
