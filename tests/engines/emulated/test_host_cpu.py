"""The host's CPU demand model (``engines.emulated.host_cpu``) and its use by engines on one
``SharedHost``: exact factors from the formula, and through the simulator, steps that slow only where
the demand overflows the cores."""

import dataclasses
import math

import pytest

from engines.emulated.host_cpu import HostCPU, host_cpu_of
from engines.emulated.profile import load_profile
from gpuhit.errors import ConfigError

FITTED = "analysis/results/live-path-2026-11-27.profile.json"


def test_no_overflow_no_slowdown_and_the_overflow_lands_by_share():
    cpu = HostCPU(cores=2, engine_cores=1, busy_extra_cores=0.1, idle_cores=0.05, per_request_s=0.004,
                  per_token_s=0.001, share=(0.75, 0.25))
    # one busy engine: 1 + 0.05 + 0.1 + 0.004 * 10 + 0.001 * 200 = 1.39 cores of 2: fits
    assert cpu.factor(0, [0], 10, 200) == 1.0
    # two busy: 2 + 0.05 + 0.2 + 0.04 + 0.2 = 2.49 cores, 0.49 over; engine 0 takes 3/4 of it
    assert cpu.factor(0, [0, 1], 10, 200) == pytest.approx(1 + 0.49 * 0.75)
    assert cpu.factor(1, [0, 1], 10, 200) == pytest.approx(1 + 0.49 * 0.25)
    # the floating demand alone can overflow: one engine busy beside 1.5 cores of tokens
    assert cpu.factor(1, [1], 0, 1500) == pytest.approx(1 + (1 + 0.05 + 0.1 + 1.5 - 2))


def test_steps_on_an_accelerator_never_slow_and_zero_shares_split_evenly():
    gpu = HostCPU(cores=2, engine_cores=0, per_token_s=1.0, share=(0.5, 0.5))
    assert gpu.factor(0, [0, 1], 100, 1e6) == 1.0
    even = HostCPU(cores=2, engine_cores=1, idle_cores=0.4, share=(0.0, 0.0))
    assert even.factor(0, [0, 1], 0, 0) == pytest.approx(1.2)


def test_the_profile_field_round_trips_and_bad_tables_are_refused():
    cpu = HostCPU(cores=2, per_token_s=0.001, share=(0.6, 0.4))
    assert host_cpu_of(cpu.to_json(), "here") == cpu
    for bad, match in (({"cores": 2}, "needs cores and share"), ({"cores": 2, "share": [1], "x": 1}, "takes only"),
                       ({"cores": 0, "share": [1]}, "positive cores"), ({"cores": 2, "share": [-1]}, "non-negative"),
                       ({"cores": 2, "share": []}, "one entry per engine"), ([1], "must be an object"),
                       ({"cores": "two", "share": [1]}, "host_cpu")):
        with pytest.raises(ConfigError, match=match):
            host_cpu_of(bad, "here")


def _two_cold_prompts(prof, sent):
    """Mean TTFT of cold 1,500-token prompts sent at ``sent`` round-robin over two emulated engines."""
    from replayer.calibrate_path import modeled_level

    level = {"concurrency": 2, "output_tokens": 16, "requests": [[t, math.nan, math.nan, 1500, 0] for t in sent]}
    got = modeled_level(level, prof, 2, {"num_gpu_blocks": 256, "max_model_len": 2048}, 0.0)
    return got["engine_ttft_model_s"], got["tpot_model_s"]


def test_simulated_engines_slow_by_the_demand_while_both_work_and_not_alone():
    plain = load_profile(FITTED)
    # the frontends need a quarter core per 100 tokens/s: two decoding engines overflow two cores
    cpu = HostCPU(cores=2, per_token_s=0.0025, share=(0.5, 0.5))
    shared = dataclasses.replace(plain, host_cpu=cpu)
    alone_sent = [0.0, 5.0]  # one engine busy at a time: the demand never overflows
    assert _two_cold_prompts(shared, alone_sent) == _two_cold_prompts(plain, alone_sent)
    both = [0.0, 0.0]  # both engines decode together: tokens at ~2 / step time overflow the cores
    ttft_p, tpot_p = _two_cold_prompts(plain, both)
    ttft_s, tpot_s = _two_cold_prompts(shared, both)
    assert tpot_s > tpot_p
    # a prefill produces a token only in its last step: its step slows by that token's demand alone
    assert ttft_p < ttft_s < 1.02 * ttft_p
    # engines on accelerators (engine_cores 0) keep the profile's step times, decode jumps and all
    gpu = dataclasses.replace(plain, host_cpu=dataclasses.replace(cpu, engine_cores=0.0))
    assert _two_cold_prompts(gpu, both) == (ttft_p, tpot_p)


def test_the_contention_table_is_not_used_where_the_cpu_model_is_given():
    plain = load_profile(FITTED)
    table = dataclasses.replace(plain, host_contention=(1.0, 3.0))
    both = dataclasses.replace(table, host_cpu=HostCPU(cores=2, share=(0.5, 0.5)))  # never overflows
    assert _two_cold_prompts(both, [0.0, 0.0]) == _two_cold_prompts(plain, [0.0, 0.0])
