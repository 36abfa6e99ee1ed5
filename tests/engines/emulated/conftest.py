"""Tiny, round-number profiles so step times and block ids can be asserted exactly."""

from __future__ import annotations

import pytest

from engines.emulated.profile import Profile


def tiny_profile(**kw) -> Profile:
    base = {
        "name": "tiny", "model": "tiny", "gpu": "none", "kv_bytes_per_token": 1000, "gpu_kv_capacity_bytes": 10**9,
        "max_model_len": 10_000, "block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 16,
        "step_overhead_s": 1.0, "per_seq_overhead_s": 0.0, "prefill_per_token_s": 0.01, "prefill_attn_s": 0.0,
        "decode_per_ctx_token_s": 0.0, "frontend_overhead_s": 0.0, "frontend_per_token_s": 0.0,
        "pcie_gbps": 1e-6, "cpu_load_overhead_s": 0.0, "nic_gbps": 1e-6, "transfer_overhead_s": 0.0,
    }
    base.update(kw)
    return Profile(**base)


@pytest.fixture
def tiny() -> Profile:
    return tiny_profile()
