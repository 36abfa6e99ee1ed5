"""`gpuhit vllm-cmd --mooncake` lines and the gateway's bootstrap / transport configuration."""

from __future__ import annotations

import json
import shlex

import pytest

from gateway import config as gcfg
from gateway.cli import vllm_commands
from gpuhit.errors import ConfigError


def test_vllm_cmd_mooncake_lines_match_vllm():
    lines = vllm_commands(2, "Qwen/Qwen3-8B", mooncake=True, mooncake_protocol="tcp", bootstrap_port=8998)
    for i, line in enumerate(lines[:2]):
        argv = shlex.split(line)
        assert argv[:3] == [f"CUDA_VISIBLE_DEVICES={i}", "VLLM_SERVER_DEV_MODE=1", f"VLLM_MOONCAKE_BOOTSTRAP_PORT={8998 + i}"]
        cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert cfg == {"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    gw = shlex.split(lines[2])
    assert [gw[i + 1] for i, a in enumerate(gw) if a == "--bootstrap"] == ["http://127.0.0.1:8998",
                                                                           "http://127.0.0.1:8999"]
    assert "--bootstrap" not in vllm_commands(1, "m")[-1]


def test_bootstrap_and_transport_config():
    cfg = gcfg.with_overrides(gcfg.GatewayConfig(), engines=["http://a:1", "http://b:2"],
                              bootstraps=["http://a:8998", "http://b:8998"], transport="aiohttp").validate()
    assert [e.bootstrap for e in cfg.engines] == ["http://a:8998", "http://b:8998"]
    assert cfg.transport == "aiohttp"
    with pytest.raises(ConfigError, match="one per engine"):
        gcfg.with_overrides(gcfg.GatewayConfig(), engines=["http://a:1"], bootstraps=["http://a:8998", "http://b:1"])
    with pytest.raises(ConfigError, match="transport must be"):
        gcfg.GatewayConfig(engines=(gcfg.EngineEntry("http://a:1", "e0"),), transport="nope").validate()
    doc = {"engines": [{"url": "http://a:1", "bootstrap": "a:8998"}]}
    with pytest.raises(ConfigError, match="bootstrap must be"):
        gcfg.from_mapping(doc).validate()


def test_nixl_producer_params_pass_to_the_consumer_as_they_are():
    """vLLM 0.32's NixlConnector producer answer (recorded by engines/vllm/pd_check.py against real
    vLLM) needs no bootstrap address: the gateway hands it to the consumer unchanged."""
    import asyncio

    from gateway.http.producer import ProducerStep
    from gateway.metrics import GatewayMetrics

    step = ProducerStep(None, None, ["a", "b"], [None, None], None, GatewayMetrics(), "m", None)  # type: ignore[arg-type]
    returned = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3, 4]],
                "remote_engine_id": "8729d2e7", "remote_request_id": "cmpl-86e3-0-bf13", "remote_host": "127.0.0.1",
                "remote_port": 49759, "tp_size": 1, "remote_num_tokens": 100, "remote_prefill_cached_tokens": 0}
    params = asyncio.run(step.consumer_params(0, "gpuhit-0-x", returned))
    assert params == returned
