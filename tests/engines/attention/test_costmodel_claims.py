"""policies.costmodel's route/fetch/local predicate reproduces seed 000's crossover claims."""

from __future__ import annotations

import pytest

from policies import costmodel as cm

IBGDA = cm.FABRICS["h100_ibgda"]
Q_P = cm.MLA_Q_BYTES + cm.MLA_P_BYTES  # 2184 B per routed row
PER_LAYER_KV = cm.MLA_D_QK * 2  # one layer's latent per token, bf16 (seed's wire-byte comparison)


def test_route_moves_76pct_fewer_bytes_at_decode_and_breaks_even_near_1080():
    # seed 5.2: at ct = 2048, Mq = 256 routing moves 76% fewer wire bytes; break-even ~1080 rows
    ct = 2048
    saved = 1 - 256 * Q_P / (ct * PER_LAYER_KV)
    assert saved == pytest.approx(0.763, abs=0.005)
    assert ct * PER_LAYER_KV / Q_P == pytest.approx(1080, abs=5)


def test_route_round_trip_and_ratio_to_fetch_splice():
    # seed 4.3: T_route(Mq=1024) measured 116 us; the model without the ~9 us turnaround gives ~105 us,
    # and routing is ~26x cheaper than fetch's 3 ms splice there
    t = cm.t_route(IBGDA, 1024)
    assert t * 1e6 == pytest.approx(105.5, abs=1.0)
    assert 20 <= cm.FETCH_SPLICE_S / t <= 35


@pytest.mark.parametrize("fabric", ["h100_ibgda", "h100_nvlink4", "a100_nvlink3", "pcie_gen5", "pcie_gen4"])
def test_decode_point_routes_on_every_fabric(fabric):
    # seed 5.5: "default to route at decode": Mq = 256, ct = 2048 -> route, tens of us, >= 60x below splice
    ch = cm.choose_primitive(cm.FABRICS[fabric], mq=256, ct=2048, t_compute_s=37e-6, t_merge_s=25e-6)
    assert ch.primitive == "route"
    assert ch.fetch_s / (ch.route_s - 62e-6) >= 60


def test_fetch_overtakes_local_between_75_and_220_tokens():
    # seed 2.2 / 5.1: fetch beats local only above ~75 (c = 1.5 us) .. ~220 (c = 0.5 us) tokens
    fast_bw = cm.Fabric("fig1b", 16.0, 70.0)  # Figure 1(b) uses BW = 70 GB/s
    hi = cm.fetch_local_crossover_tokens(fast_bw, local_c_s=cm.LOCAL_C_HIGH_S)
    lo = cm.fetch_local_crossover_tokens(fast_bw, local_c_s=cm.LOCAL_C_LOW_S)
    assert 70 <= hi <= 80
    assert 200 <= lo <= 240


def test_route_cedes_only_when_the_query_batch_outgrows_the_chunk():
    # seed 5.1: route loses only where Mq >~ ct (it would ship more than the chunk): local wins there
    assert cm.choose_primitive(IBGDA, mq=16384, ct=16).primitive == "local"
    assert cm.choose_primitive(IBGDA, mq=16, ct=16384).primitive == "route"
