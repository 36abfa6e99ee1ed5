"""The host-CPU probe of ``gpuhit profile fit`` (``replayer.calibrate_cpu``): its reduction from raw
levels to per-request and per-token CPU costs and the profile's ``host_cpu``, and the probe itself
against emulated engines on real loopback sockets (each serving its process's CPU seconds as vLLM's
API server does). The probe on the real vLLM pair: ``tests/e2e/test_real_vllm_liveab.py``."""

import asyncio
import random

import pytest

from engines.emulated.host_cpu import HostCPU
from gpuhit.errors import ConfigError, EngineError
from replayer.calibrate_cpu import frontend_costs, host_cpu_from, measure_frontend_cpu


def _level(tokens, wall, own, api, n=(8, 8)):
    return {"output_tokens": tokens, "wall_s": wall, "own_cpu_s": own,
            "engines": [{"cpu_s": c, "requests": k} for c, k in zip(api, n)]}


# API servers: 0.01 cores idle, 3 ms per request and 0.5 ms per token; client and gateway: 0.02 cores
# idle, 2 ms per request and 0.1 ms per token; 16 requests per level
LEVELS = [_level(0, 2.0, 0.04, (0.01, 0.01)),
          _level(1, 4.0, 0.08 + 16 * (0.002 + 0.0001), (0.02 + 8 * 0.0035, 0.02 + 8 * 0.0035)),
          _level(33, 10.0, 0.2 + 16 * (0.002 + 0.0033), (0.05 + 8 * 0.0195, 0.05 + 8 * 0.0195))]


def test_per_request_and_per_token_costs_come_apart_after_the_idle_rate():
    got = frontend_costs(LEVELS)
    assert got["api"] == pytest.approx({"idle_cores": 0.01, "per_request_s": 0.003, "per_token_s": 0.0005})
    assert got["client_gateway"] == pytest.approx({"idle_cores": 0.02, "per_request_s": 0.002, "per_token_s": 0.0001})
    assert frontend_costs(LEVELS[::-1]) == got
    with pytest.raises(ConfigError, match="one idle level"):
        frontend_costs(LEVELS[1:])
    with pytest.raises(EngineError, match="counted no requests"):
        frontend_costs([LEVELS[0], LEVELS[1], _level(33, 1.0, 0.1, (0.1, 0.1), n=(0, 0))])


def _host_level(busy, per_engine, wall):
    return {"busy": busy, "requests": 4, "output_tokens": 16, "wall_s": wall, "engine": {
        str(i): {"prefill": [4 * per_engine[i], 4], "decode": [0.0, 4], "queue": [0.0, 4]} for i in busy}}


def test_the_shared_host_probe_sets_the_shares_and_the_unexplained_demand_per_busy_engine():
    costs = frontend_costs(LEVELS)
    load = [_host_level([0], {0: 0.2}, 1.0), _host_level([1], {1: 0.2}, 1.0),
            _host_level([0, 1], {0: 0.3, 1: 0.22}, 2.0)]
    got = host_cpu_from(costs, load, 2, 2.0, 1.0)
    h = got["host_cpu"]
    assert h["share"] == pytest.approx([0.5 / 0.6, 0.1 / 0.6])
    chk = got["contention_check"]
    # 8 requests and 128 tokens in 2 s at the costs above: 0.03 + 0.005 * 4 + 0.0006 * 64 cores
    assert chk["frontend_cores"] == pytest.approx(0.03 + 0.02 + 0.0384)
    assert chk["needed_floating_cores"] == pytest.approx(0.6)
    assert h["busy_extra_cores"] == pytest.approx((0.6 - chk["frontend_cores"]) / 2)
    # the model with these costs gives back the probe's mean slowdown at the probe's rates
    cpu = HostCPU(**{k: (tuple(v) if k == "share" else v) for k, v in h.items()})
    f = [cpu.factor(i, [0, 1], chk["request_rate"], chk["token_rate"]) for i in (0, 1)]
    assert f == pytest.approx([1.5, 1.1])
    # without the shared-host probe: even shares, nothing unexplained
    alone = host_cpu_from(costs, None, 2, 2.0, 1.0)["host_cpu"]
    assert alone["share"] == [0.5, 0.5] and alone["busy_extra_cores"] == 0.0
    assert alone["per_token_s"] == pytest.approx(0.0006) and alone["idle_cores"] == pytest.approx(0.03)


def test_the_probe_reads_both_api_servers_and_this_process_over_three_levels():
    from tests.e2e.helpers import emulated, servers

    async def run():
        import aiohttp

        async with emulated(["a", "b"], num_gpu_blocks=256, block_size=32) as engines, servers(engines) as srvs:
            urls = [f"http://127.0.0.1:{s.port}" for s in srvs]
            async with aiohttp.ClientSession() as http:
                info = {"model": "m", "block_size": 32, "max_model_len": 2048, "num_gpu_blocks": 256}
                return await measure_frontend_cpu(http, urls, info, [64, 96], 6, 2, (1, 4), 0.05,
                                                  random.Random(0), 30.0, lambda _: None)

    levels = asyncio.run(run())
    assert [lv["output_tokens"] for lv in levels] == [0, 1, 4]
    for lv in levels:
        assert lv["wall_s"] > 0 and lv["own_cpu_s"] >= 0 and len(lv["engines"]) == 2
        assert sum(e["requests"] for e in lv["engines"]) == (6 if lv["output_tokens"] else 0)
        assert all(e["cpu_s"] >= 0 for e in lv["engines"])
    assert set(frontend_costs(levels)) == {"api", "client_gateway"}


def test_the_hosts_cores_are_this_machines_only_for_engines_on_loopback():
    import argparse
    import os

    from replayer.calibrate import _cpu_args

    def args(**kw):
        base = {"cpu_tokens": "1,32", "cpu_requests": 8, "cpu_clients": 2, "engine_cores": 1.0, "host_cores": None}
        return argparse.Namespace(**{**base, **kw})

    assert _cpu_args(args(), ["http://127.0.0.1:8000"]) == ((1, 32), float(os.cpu_count()))
    assert _cpu_args(args(host_cores=64.0), ["http://gpu-node:8000"]) == ((1, 32), 64.0)
    with pytest.raises(ConfigError, match="--host-cores is needed"):
        _cpu_args(args(), ["http://gpu-node:8000"])
    for bad in ({"cpu_tokens": "32,1"}, {"cpu_tokens": "x"}, {"engine_cores": -1.0}, {"host_cores": 0.0}):
        with pytest.raises(ConfigError):
            _cpu_args(args(**bad), ["http://127.0.0.1:8000"])
