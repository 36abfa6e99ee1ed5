import json

import pytest

from engines.emulated.profile import available_profiles, load_profile
from gpuhit.errors import ConfigError


def test_bundled_profiles_load_and_cite_sources():
    names = available_profiles()
    assert "qwen3-coder-30b-a3b@h20" in names
    assert any("h100" in n for n in names)
    for n in names:
        p = load_profile(n)
        assert p.sources and p.kv_bytes_per_token > 0
    assert load_profile("qwen3-coder-30b-a3b@h20").kv_bytes_per_token == 96 * 1024


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ConfigError, match="qwen3-coder-30b-a3b@h20"):
        load_profile("gpt-9@tpu")


def test_user_json_file(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"profiles": {"m@x": {"model": "m", "gpu": "x", "kv_bytes_per_token": 10,
                                                    "gpu_kv_capacity_bytes": 1000, "max_model_len": 64}}}))
    p = load_profile(f"{f}#m@x")
    assert p.name == "m@x" and p.num_gpu_blocks() == 1000 // 160 + 1
    with pytest.raises(ConfigError, match="unknown fields"):
        f.write_text(json.dumps({"profiles": {"m": {"model": "m", "gpu": "x", "kv_bytes_per_token": 1,
                                                      "gpu_kv_capacity_bytes": 1, "max_model_len": 1, "oops": 1}}}))
        load_profile(str(f))


def test_prefill_cost_is_chunking_invariant():
    p = load_profile("qwen3-coder-30b-a3b@h20")
    whole = p.prefill_cost(20000, 0)
    chunks = p.prefill_cost(8192, 0) + p.prefill_cost(8192, 8192) + p.prefill_cost(3616, 16384)
    assert chunks == pytest.approx(whole, rel=1e-12)
