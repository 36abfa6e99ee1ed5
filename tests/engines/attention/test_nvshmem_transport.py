"""The NVSHMEM route-the-query protocol, through the in-process fake (2..4 PEs) and, on a GPU, the real
nvshmem4py with one PE routing to itself."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engines.attention.fake_nvshmem import FakeNvshmemError, FakeNvshmemWorld
from engines.attention.nvshmem_transport import NvshmemHolderService, NvshmemPE, NvshmemQueryTransport
from engines.attention.transports import Holder, InProcessTransport, route_and_merge
from engines.attention.wire import RouteRequest
from gpuhit.errors import BadRequestError, ConfigError, TransferError, UnavailableError
from tests.engines.attention.test_transports import SCALE, cluster, local_partial

SLOT = 128 * 1024  # 4 rows x 8 heads x 576 fp32 = 72 KiB of q


def fake_cluster(n_holders: int, *, slot_bytes: int = SLOT, wire_dtype=None, dtype=torch.float32):
    """PE 0 is the requester; holders h0.. sit on PEs 1..n_holders, each with its own service."""
    holders, local, q, q_pos, ref = cluster(n_holders=n_holders, dtype=dtype)
    world = FakeNvshmemWorld(n_holders + 1)
    pes = [NvshmemPE(world.core(i), slot_bytes=slot_bytes) for i in range(world.n_pes)]
    services = {name: NvshmemHolderService(h, pes[i + 1], wire_dtype=wire_dtype) for i, (name, h) in enumerate(holders.items())}

    def pump():
        for s in services.values():
            s.serve_once()

    t = NvshmemQueryTransport({name: i + 1 for i, name in enumerate(holders)}, pe=pes[0], wire_dtype=wire_dtype, pump=pump)
    return t, services, holders, local, q, q_pos, ref, world


@pytest.mark.parametrize("n_holders", [1, 2, 3])
def test_routed_merge_equals_in_process(n_holders):
    t, services, holders, local, q, q_pos, ref, world = fake_cluster(n_holders)
    reqs = {name: RouteRequest(q, SCALE, None, q_pos) for name in holders}
    o = route_and_merge(t, reqs, [local_partial(local, q, q_pos)])
    # the same holders through the in-process transport (tensors, no wire) give the same answer
    fresh, local2, q2, q_pos2, _ = cluster(n_holders=n_holders)
    o_ip = route_and_merge(InProcessTransport(fresh), {n: RouteRequest(q2, SCALE, None, q_pos2) for n in fresh},
                           [local_partial(local2, q2, q_pos2)])
    assert torch.equal(o, o_ip)
    if n_holders == 3:
        assert float((o.double() - ref).abs().max()) <= 1e-5
    assert t.stats.requests == n_holders and t.stats.failures == 0
    assert [s.served for s in services.values()] == [1] * n_holders
    assert [h.stats.requests for h in holders.values()] == [1] * n_holders
    # each route is one put_signal there and one back
    assert world.puts == 2 * n_holders and world.signals == 2 * n_holders
    assert t.stats.bytes_sent > 0 and t.stats.bytes_received > 0


def test_bf16_wire_matches_in_process_wire_and_byte_counts():
    t, _, holders, local, q, q_pos, ref, _ = fake_cluster(3, wire_dtype=torch.bfloat16, dtype=torch.bfloat16)
    reqs = {name: RouteRequest(q, SCALE, None, q_pos) for name in holders}
    o = route_and_merge(t, reqs, [local_partial(local, q, q_pos)])
    fresh, local2, q2, q_pos2, _ = cluster(dtype=torch.bfloat16)
    ip = InProcessTransport(fresh, wire_dtype=torch.bfloat16)
    o_ip = route_and_merge(ip, {n: RouteRequest(q2, SCALE, None, q_pos2) for n in fresh}, [local_partial(local2, q2, q_pos2)])
    assert torch.equal(o, o_ip)
    assert float((o.double() - ref).abs().max()) <= 0.05
    # the same codec bytes plus one 24-byte slot header each way
    assert t.stats.bytes_sent == ip.stats.bytes_sent + 3 * 24
    assert t.stats.bytes_received == ip.stats.bytes_received + 3 * 24


def test_four_pes_two_requesters_share_a_holder_without_clobbering():
    """Per-source inbox slots: PEs 0 and 1 both have a request at holder PE 3 before it serves."""
    holders, _, q, q_pos, _ = cluster(n_holders=1)
    world = FakeNvshmemWorld(4)
    pes = [NvshmemPE(world.core(i), slot_bytes=SLOT) for i in range(4)]
    service = NvshmemHolderService(holders["h0"], pes[3])
    a = NvshmemQueryTransport({"h0": 3}, pe=pes[0])
    b = NvshmemQueryTransport({"h0": 3}, pe=pes[1])
    req_a = RouteRequest(q[:2], SCALE, ("c0a",), q_pos[:2])
    req_b = RouteRequest(q[2:], SCALE, None, q_pos[2:])
    sa, sb = a.send("h0", req_a), b.send("h0", req_b)
    assert (sa, sb) == (1, 1)  # sequence numbers are per requester
    assert a.receive(sa) is None and b.receive(sb) is None
    assert service.serve_once() == 2 and service.serve_once() == 0
    pa, pb = a.receive(sa), b.receive(sb)
    want_a, want_b = holders["h0"].answer(req_a), holders["h0"].answer(req_b)
    assert torch.equal(pa.o, want_a.o) and torch.equal(pa.m, want_a.m) and torch.equal(pa.l, want_a.l)
    assert torch.equal(pb.o, want_b.o) and torch.equal(pb.l, want_b.l)


def test_one_requester_outstanding_at_several_holders_then_receives_in_any_order():
    t, services, holders, _, q, q_pos, _, _ = fake_cluster(3)
    seqs = {name: t.send(name, RouteRequest(q, SCALE, None, q_pos)) for name in holders}
    assert list(seqs.values()) == [1, 2, 3]
    for s in services.values():
        assert s.serve_once() == 1
    for name in reversed(list(holders)):
        got = t.receive(seqs[name])
        assert torch.equal(got.o, holders[name].answer(RouteRequest(q, SCALE, None, q_pos)).o)
    with pytest.raises(BadRequestError, match="no outstanding NVSHMEM route request 2"):
        t.receive(2)


def test_oversize_request_is_a_transfer_error_and_sends_nothing():
    t, _, _, _, q, q_pos, _, world = fake_cluster(1, slot_bytes=1024)
    with pytest.raises(TransferError, match="does not fit holder 'h0'"):
        t.send("h0", RouteRequest(q, SCALE, None, q_pos))
    assert t.stats.failures == 1 and t.stats.requests == 0 and world.puts == 0


def test_oversize_reply_comes_back_as_a_clear_error():
    """d_v 256 > d_qk 8: the request fits a 2 KiB slot, the 4 x 256 fp32 partial does not."""
    world = FakeNvshmemWorld(2)
    pes = [NvshmemPE(world.core(i), slot_bytes=2048) for i in range(2)]
    h = Holder("wide")
    h.add_chunk("c", torch.ones(3, 1, 8), torch.ones(3, 1, 256))
    service = NvshmemHolderService(h, pes[1])
    t = NvshmemQueryTransport({"wide": 1}, pe=pes[0], pump=service.serve_once)
    with pytest.raises(TransferError, match=r"could not answer request 1: TransferError: partial of \d+ B does not fit"):
        t.route("wide", RouteRequest(torch.ones(4, 1, 8), 1.0))
    assert service.errors == 1 and service.served == 0 and t.stats.failures == 1
    # the slot is free again: a smaller request to the same holder works
    p = t.route("wide", RouteRequest(torch.ones(1, 1, 8), 1.0))
    assert p.o.shape == (1, 1, 256) and torch.equal(p.o, torch.ones(1, 1, 256))


def test_missing_chunk_on_the_holder_is_reported_not_timed_out():
    t, services, _, _, q, _, _, _ = fake_cluster(1)
    with pytest.raises(TransferError, match="NotFoundError: holder h0: chunks not resident"):
        t.route("h0", RouteRequest(q, SCALE, ("nope",)))
    assert services["h0"].errors == 1


def test_unknown_holder_and_bad_config():
    t, _, _, _, q, _, _, world = fake_cluster(1)
    with pytest.raises(TransferError, match="no holder 'h9'"):
        t.route("h9", RouteRequest(q, SCALE))
    assert t.stats.failures == 1 and world.puts == 0
    with pytest.raises(ConfigError, match=r"PE 5 is not in \[0, 2\)"):
        NvshmemQueryTransport({"far": 5}, pe=t.pe)
    with pytest.raises(ConfigError, match="slot_bytes"):
        NvshmemPE(FakeNvshmemWorld(1).core(0), slot_bytes=30)


def test_no_reply_after_max_pumps_then_stale_reply_is_ignored():
    t, services, holders, _, q, q_pos, _, _ = fake_cluster(1)
    silent = NvshmemQueryTransport({"h0": 1}, pe=t.pe, max_pumps=5)  # same PE, never pumps the holder
    req = RouteRequest(q, SCALE, None, q_pos)
    with pytest.raises(TransferError, match=r"no reply from holder 'h0' \(PE 1\) for request 1 after 5 polls"):
        silent.route("h0", req)
    assert silent.stats.failures == 1
    # the holder answers request 1 late: its reply lands, but nobody waits for seq 1 any more
    assert services["h0"].serve_once() == 1
    seq = silent.send("h0", req)
    assert seq == 2
    assert silent.receive(seq) is None  # the reply slot holds seq 1's answer: stale, ignored
    assert services["h0"].serve_once() == 1
    got = silent.receive(seq)
    assert torch.equal(got.o, holders["h0"].answer(req).o)


def test_sequence_numbers_increase_and_one_request_per_holder_at_a_time():
    t, services, _, _, q, q_pos, _, _ = fake_cluster(1)
    req = RouteRequest(q, SCALE, None, q_pos)
    assert t.route("h0", req) is not None
    s2 = t.send("h0", req)
    assert s2 == 2
    with pytest.raises(BadRequestError, match="request 2 to holder 'h0' .* still outstanding"):
        t.send("h0", req)
    assert t.receive(s2) is None  # reply slot still holds seq 1's answer
    services["h0"].serve_once()
    assert t.receive(s2) is not None
    assert t.send("h0", req) == 3


def test_route_to_self_on_one_pe():
    holders, _, q, q_pos, _ = cluster(n_holders=1)
    pe = NvshmemPE(FakeNvshmemWorld(1).core(0), slot_bytes=SLOT)
    service = NvshmemHolderService(holders["h0"], pe)
    t = NvshmemQueryTransport({"self": 0}, pe=pe, pump=service.serve_once)
    req = RouteRequest(q, SCALE, None, q_pos)
    got = t.route("self", req)
    assert torch.equal(got.o, holders["h0"].answer(req).o)
    pe.close()
    assert all(x is None for x in pe.lib.core._world.heaps[0])


def test_core_injection_builds_its_own_pe_and_fake_enforces_symmetric_use():
    world = FakeNvshmemWorld(2)
    t = NvshmemQueryTransport({"h": 1}, core=world.core(0), slot_bytes=SLOT)
    assert t.pe.my_pe == 0 and t.pe.n_pes == 2
    # PE 1 never built its slots: a put there is an asymmetric use the fake refuses
    with pytest.raises(TransferError, match="put_signal from PE 0 to PE 1 failed: .*not allocated alike on PE 1"):
        t.send("h", RouteRequest(torch.ones(1, 1, 8), 1.0))
    assert t.stats.failures == 1 and t.stats.requests == 0
    core = world.core(0)
    with pytest.raises(FakeNvshmemError, match="not tracked"):
        core.tensor_get_buffer(t.pe.out_req[8:])


def test_unavailable_without_cuda_when_no_library_is_injected():
    if torch.cuda.is_available():
        pytest.skip("this test pins the CPU behaviour")
    with pytest.raises(UnavailableError, match="CUDA GPU"):
        NvshmemQueryTransport({"h": 0})


def _nvshmem_ready() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    try:
        import nvshmem.core  # noqa: F401
    except ImportError as exc:
        return False, f"needs nvshmem4py ({exc})"
    return True, ""


_GPU_OK, _GPU_WHY = _nvshmem_ready()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU_OK, reason=_GPU_WHY)
def test_gpu_real_nvshmem_single_pe_routes_to_itself():
    """GPU ONLY: the real nvshmem4py, one PE (UID init with nranks=1), holder and requester on PE 0."""
    from nvshmem import core

    from engines.attention.nvshmem_lib import init_uid

    init_uid(core, rank=0, nranks=1)
    try:
        holders, _, q, q_pos, _ = cluster(n_holders=1)
        dev = torch.device("cuda")
        h = Holder("h0")  # the same chunks, resident on the GPU
        for cid in holders["h0"].chunk_ids:
            k, v, pos = _kv(holders["h0"], cid)
            h.add_chunk(cid, k.to(dev), v.to(dev), pos.to(dev))
        pe = NvshmemPE(core, slot_bytes=256 * 1024)
        service = NvshmemHolderService(h, pe)
        t = NvshmemQueryTransport({"self": 0}, pe=pe, pump=service.serve_once, max_pumps=10_000)
        req = RouteRequest(q.to(dev), SCALE, None, q_pos.to(dev))
        got = t.route("self", req)
        want = h.answer(req)
        assert torch.equal(got.o, want.o.cpu()) and torch.equal(got.l, want.l.cpu())
        assert service.served == 1 and t.stats.failures == 0
        pe.close()
    finally:
        core.finalize()


def _kv(holder: Holder, cid: str):
    ch = holder._chunks[cid]
    return ch.k, ch.v, ch.positions
