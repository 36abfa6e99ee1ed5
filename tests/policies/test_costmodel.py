from __future__ import annotations

import pytest

from gpuhit.errors import ConfigError
from policies.costmodel import (
    FABRICS,
    PrefillProfile,
    ServingCostModel,
    choose_primitive,
    fetch_local_crossover_tokens,
    get_fabric,
    t_fetch,
    t_route,
)


def test_prefill_profile_matches_seed_miss_column():
    p = PrefillProfile()
    for L, seed in [(8000, 0.588), (16000, 1.547), (32000, 4.604), (64000, 15.23)]:
        assert abs(p.time(L) - seed) / seed < 0.01
    # Extending a cached context costs attention over the whole context.
    assert p.time(100, 16000) == pytest.approx(50e-6 * 100 + 2.94e-9 * (16100**2 - 16000**2))


def test_seed000_route_fetch_local_points():
    ib = FABRICS["h100_ibgda"]
    assert t_route(ib, 1024) == pytest.approx(16e-6 + 1024 * 2184 / 25e9)  # ~105 us (seed: 116 measured)
    assert t_fetch(ib, 2048) == pytest.approx(3e-3 + 2048 * 31104 / 25e9)  # splice + ~2.5 ms pull
    assert choose_primitive(ib, mq=256, ct=2048).primitive == "route"
    assert choose_primitive(ib, mq=8192, ct=10).primitive == "local"  # route ships far more than the chunk
    # fetch overtakes local above ~75-220 tokens (c = 1.5 .. 0.5 us per token x layer)
    assert 70 < fetch_local_crossover_tokens(ib, local_c_s=1.5e-6) < 80
    assert 200 < fetch_local_crossover_tokens(ib, local_c_s=0.5e-6, splice_s=2.77e-3) < 240


def test_fabrics_and_overrides():
    assert {k: (f.probe_us, f.bw_gbps) for k, f in FABRICS.items() if k != "nic"} == {
        "h100_ibgda": (16.0, 25.0), "h100_nvlink4": (1.2, 21.0), "a100_nvlink3": (1.6, 18.0),
        "pcie_gen5": (4.8, 22.0), "pcie_gen4": (8.7, 19.0),
    }
    assert get_fabric("nic", bw_gbps=50).bw_gbps == 50
    with pytest.raises(ConfigError, match="unknown fabric"):
        get_fabric("x")
    with pytest.raises(ConfigError):
        ServingCostModel(producer_wait=2)


def test_serving_options():
    m = ServingCostModel(producer_wait=0.0)
    stay = m.stay(target=0, pending_prefill_tokens=1000, input_tokens=16100, hit_tokens=16000)
    assert stay.total_s == pytest.approx(1000 * 50e-6 + m.profile.time(100, 16000))
    f = m.fetch(source=0, target=1, source_pending_prefill_tokens=10**6, target_pending_prefill_tokens=0,
                input_tokens=16100, source_hit_tokens=16000, target_hit_tokens=0)
    xfer = 16e-6 + 16000 * 98304 / 9.7e9
    assert f.transfer_s == pytest.approx(xfer) and f.total_s == pytest.approx(xfer + m.profile.time(100, 16000))
