"""vLLM's startup rule: one max_model_len request must fit the KV cache (profiles and engines)."""

from __future__ import annotations

import json

import pytest

from engines.emulated.engine import EmulatedEngine
from engines.emulated.profile import available_profiles, check_enough_kv_cache, load_profile
from gpuhit.errors import ConfigError


def test_every_bundled_profile_fits_one_max_model_len_request():
    for name in available_profiles():
        p = load_profile(name)
        assert -(-p.max_model_len // p.block_size) <= p.num_gpu_blocks() - 1, name
        for bs in (16, 32, 64):  # the replay's --block-size choices build engines too
            EmulatedEngine("e", p, block_size=bs)


def test_refused_with_vllms_message_and_estimate():
    # The H20 profile's numbers: 20 GB / 96 KiB per token = 12,715 usable blocks of 16 = 203,440 tokens
    with pytest.raises(ConfigError) as e:
        EmulatedEngine("e", "qwen3-coder-30b-a3b@h20", max_model_len=262_144)
    msg = str(e.value)
    assert msg.startswith("To serve at least one request with the model's max seq len (262144), (24.0 GiB KV cache "
                          "is needed, which is larger than the available KV cache memory (18.63 GiB).")
    assert "the estimated maximum model length is 203440" in msg
    check_enough_kv_cache(203_440, 12_716, 16, 16 * 98_304)  # exactly fits
    with pytest.raises(ConfigError):
        check_enough_kv_cache(203_441, 12_716, 16, 16 * 98_304)


def test_profile_file_with_inconsistent_max_model_len_is_refused(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"profiles": {"x": {"model": "m", "gpu": "g", "kv_bytes_per_token": 10,
                                                "gpu_kv_capacity_bytes": 1600, "max_model_len": 161}}}))
    with pytest.raises(ConfigError, match="estimated maximum model length is 160"):
        load_profile(f)
