"""gateway.config (TOML + flags) and `gpuhit vllm-cmd` output."""

from __future__ import annotations

import json
import shlex

import pytest

from gateway import config as gcfg
from gateway.cli import vllm_commands
from gpuhit.cli import main
from gpuhit.errors import ConfigError

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
    assert first[:4] == ["CUDA_VISIBLE_DEVICES=0", "VLLM_MOONCAKE_BOOTSTRAP_PORT=8998", "vllm", "serve"]
    assert first[4] == "Qwen/Qwen3-Coder-30B-A3B-Instruct"
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
    assert second[:2] == ["CUDA_VISIBLE_DEVICES=1", "VLLM_MOONCAKE_BOOTSTRAP_PORT=8999"]
    assert json.loads(second[second.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:5559"
    assert lines[2] == ("gpuhit serve --port 8080 --policy lpwl --index precise --block-size 16 "
                        "--engine http://127.0.0.1:8000 --engine http://127.0.0.1:8001 "
                        "--bootstrap http://127.0.0.1:8998 --bootstrap http://127.0.0.1:8999")


def test_vllm_cmd_shared_gpu_splits_memory(capsys):
    assert main(["vllm-cmd", "--instances", "2", "--model", "m", "--gpu-ids", "3,3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all("CUDA_VISIBLE_DEVICES=3" in line and "--gpu-memory-utilization 0.45" in line for line in out[:2])
    assert "--kv-transfer-config" not in out[0]


def test_vllm_cmd_rejects_gpu_count_mismatch(capsys):
    assert main(["vllm-cmd", "--instances", "3", "--model", "m", "--gpu-ids", "0,1"]) == 2
    assert "one per instance" in capsys.readouterr().err
