"""Route-the-query transports end to end: in-process (tensors and bf16 wire bytes) and Mooncake TCP."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engines.attention.nvshmem_transport import NvshmemQueryTransport
from engines.attention.partial import mla_kv, partial_attention, reference_attention
from engines.attention.transports import (
    Holder,
    InProcessTransport,
    MooncakeHolderService,
    MooncakeQueryTransport,
    route_and_merge,
)
from engines.attention.wire import (
    RouteRequest,
    decode_partial,
    decode_request,
    encode_partial,
    encode_request,
)
from engines.transfer.mooncake import mooncake_available
from gpuhit.errors import NotFoundError, TransferError, UnavailableError

SCALE = 192**-0.5


def cluster(n_tokens=48, n_holders=3, dtype=torch.float32):
    """Three holders own consecutive chunks of one MLA context; the requester keeps the tail."""
    gen = torch.Generator().manual_seed(11)
    k, v = mla_kv(torch.randn(n_tokens, 576, generator=gen).to(dtype))
    pos = torch.arange(n_tokens)
    bounds = [0, 10, 25, 40, n_tokens]
    holders = {}
    for i in range(n_holders):
        h = Holder(f"h{i}")
        a, b = bounds[i], bounds[i + 1]
        h.add_chunk(f"c{i}a", k[a : (a + b) // 2], v[a : (a + b) // 2], pos[a : (a + b) // 2])
        h.add_chunk(f"c{i}b", k[(a + b) // 2 : b], v[(a + b) // 2 : b], pos[(a + b) // 2 : b])
        holders[h.name] = h
    local = (k[40:], v[40:], pos[40:])
    q = torch.randn(4, 8, 576, generator=gen).to(dtype)
    q_pos = torch.tensor([5, 30, 44, 47])
    ref = reference_attention(q.float(), k.float(), v.float(), scale=SCALE, mask=pos[None, :] <= q_pos[:, None])
    return holders, local, q, q_pos, ref


def local_partial(local, q, q_pos):
    k, v, pos = local
    return partial_attention(q, k, v, scale=SCALE, q_positions=q_pos, k_positions=pos)


def test_in_process_route_equals_single_instance():
    holders, local, q, q_pos, ref = cluster()
    t = InProcessTransport(holders)
    reqs = {name: RouteRequest(q, SCALE, None, q_pos) for name in holders}
    o = route_and_merge(t, reqs, [local_partial(local, q, q_pos)])
    assert float((o.double() - ref).abs().max()) <= 1e-5
    assert t.stats.requests == 3 and t.stats.failures == 0
    assert [h.stats.requests for h in holders.values()] == [1, 1, 1]


def test_in_process_bf16_wire_within_floor_and_payload_sizes():
    holders, local, q, q_pos, ref = cluster(dtype=torch.bfloat16)
    t = InProcessTransport(holders, wire_dtype=torch.bfloat16)
    reqs = {name: RouteRequest(q, SCALE, None, q_pos) for name in holders}
    o = route_and_merge(t, reqs, [local_partial(local, q, q_pos)])
    assert float((o.double() - ref).abs().max()) <= 0.05
    # per holder: 4 rows x 8 heads x (576 x 2 B) of q plus 4 x 8 int64 positions plus a header;
    # back 4 x 8 x (512 x 2 + 4 + 4) B: seed 000's q = 1152 B and p = 1032 B per row
    rows = 4 * 8
    assert t.stats.bytes_received == 3 * (rows * 1032 + 17)
    assert t.stats.bytes_sent == 3 * (rows * 1152 + 4 * 8 + 28 + 4)


def test_codec_round_trip_and_chunk_selection():
    holders, _, q, q_pos, _ = cluster()
    req = RouteRequest(q, SCALE, ("c1a",), q_pos)
    back = decode_request(encode_request(req))
    assert back.chunk_ids == ("c1a",) and back.scale == SCALE
    assert torch.equal(back.q, q) and torch.equal(back.q_positions, q_pos)
    p = holders["h1"].answer(req)
    p2 = decode_partial(encode_partial(p))
    assert torch.equal(p.o, p2.o) and torch.equal(p.m, p2.m) and torch.equal(p.l, p2.l)
    with pytest.raises(NotFoundError, match="not resident"):
        holders["h0"].answer(RouteRequest(q, SCALE, ("nope",)))
    with pytest.raises(TransferError, match="bad magic"):
        decode_partial(b"XXXX" + bytes(20))


def test_unknown_holder_is_a_transfer_error():
    holders, _, q, _, _ = cluster()
    t = InProcessTransport(holders)
    with pytest.raises(TransferError, match="no holder 'h9'"):
        t.route("h9", RouteRequest(q, SCALE))
    assert t.stats.failures == 1


def test_nvshmem_transport_is_unavailable_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("this test pins the CPU behaviour")
    with pytest.raises(UnavailableError, match="CUDA GPU"):
        NvshmemQueryTransport()


_OK, _WHY = mooncake_available()


@pytest.mark.mooncake
@pytest.mark.skipif(not _OK, reason=_WHY)
def test_mooncake_tcp_route_equals_single_instance():
    from engines.transfer.mooncake import MooncakeTransfer

    holders, local, q, q_pos, ref = cluster()
    requester = MooncakeTransfer("127.0.0.1")
    services = {name: MooncakeHolderService(h, MooncakeTransfer("127.0.0.1")) for name, h in holders.items()}
    pending = list(services.values())

    def pump():
        for s in pending:
            s.serve_once()

    t = MooncakeQueryTransport(requester, {n: s.endpoint for n, s in services.items()}, pump=pump)
    reqs = {name: RouteRequest(q, SCALE, None, q_pos) for name in holders}
    o = route_and_merge(t, reqs, [local_partial(local, q, q_pos)])
    assert float((o.double() - ref).abs().max()) <= 1e-5
    assert t.stats.requests == 3 and t.stats.failures == 0
    assert [s.served for s in services.values()] == [1, 1, 1]
    # every request and reply really crossed the transfer engine: 2 writes (payload + doorbell) each way
    assert requester.stats.writes == 6 and requester.stats.failures == 0
    assert requester.stats.bytes_written == t.stats.bytes_sent
    assert sum(s.transfer.stats.bytes_written for s in services.values()) == t.stats.bytes_received
    # a holder endpoint nobody listens on: a clear TransferError, counted
    from engines.attention.transports import HolderEndpoint

    bad = MooncakeQueryTransport(requester, {"gone": HolderEndpoint("127.0.0.1:1", 4096, 1 << 20)})
    with pytest.raises(TransferError, match="127.0.0.1:1"):
        bad.route("gone", reqs["h0"])
    assert bad.stats.failures == 1
