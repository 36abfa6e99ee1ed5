"""The in-process KV transfer: same interface and failure semantics as Mooncake, no sockets."""

from __future__ import annotations

import random

import pytest

from engines.transfer.inprocess import InProcessFabric
from gpuhit import vtime
from gpuhit.errors import BadRequestError, ConfigError, TransferError

BLOCK = 256


def test_blocks_move_exactly_and_are_counted():
    fab = InProcessFabric()
    a, b = fab.endpoint("a"), fab.endpoint("b")
    abuf, bbuf = a.allocate(8 * BLOCK), b.allocate(8 * BLOCK)
    data = random.Random(1).randbytes(8 * BLOCK)
    a.write_local(abuf.addr, data)
    b.read_blocks("a", [(bbuf.addr + 0 * BLOCK, abuf.addr + 5 * BLOCK), (bbuf.addr + 3 * BLOCK, abuf.addr + 1 * BLOCK)], BLOCK)
    assert b.read_local(bbuf.addr, BLOCK) == data[5 * BLOCK : 6 * BLOCK]
    assert b.read_local(bbuf.addr + 3 * BLOCK, BLOCK) == data[BLOCK : 2 * BLOCK]
    assert b.read_local(bbuf.addr + BLOCK, BLOCK) == bytes(BLOCK)
    b.write("a", bbuf.addr, abuf.addr + 7 * BLOCK, BLOCK)
    assert a.read_local(abuf.addr + 7 * BLOCK, BLOCK) == data[5 * BLOCK : 6 * BLOCK]
    assert b.stats.as_dict() == {
        "bytes_written": BLOCK, "bytes_read": 2 * BLOCK, "writes": 1, "reads": 2, "failures": 0, "time_s": 0.0,
    }
    assert a.stats.bytes_moved == 0  # one-sided: the target does nothing and counts nothing


def test_failures_are_clear_and_counted():
    fab = InProcessFabric()
    a, b = fab.endpoint("a"), fab.endpoint("b")
    abuf, bbuf = a.allocate(BLOCK), b.allocate(2 * BLOCK)
    with pytest.raises(TransferError, match="no in-process transfer endpoint 'zz'"):
        b.read("zz", bbuf.addr, abuf.addr, BLOCK)
    with pytest.raises(TransferError, match="outside a's registered memory"):
        b.read_blocks("a", [(bbuf.addr, abuf.addr), (bbuf.addr + BLOCK, abuf.addr + BLOCK)], BLOCK)
    assert b.read_local(bbuf.addr, BLOCK) == bytes(BLOCK)  # a failed batch copies nothing
    assert b.stats.failures == 2 and b.stats.bytes_moved == 0
    with pytest.raises(BadRequestError, match="not inside a buffer"):
        b.read("a", bbuf.addr + 2 * BLOCK, abuf.addr, BLOCK)
    with pytest.raises(ConfigError, match="already exists"):
        fab.endpoint("a")
    a.close()
    with pytest.raises(TransferError, match="no in-process transfer endpoint 'a'"):
        b.read("a", bbuf.addr, abuf.addr, BLOCK)


def test_time_is_read_from_the_injected_clock():
    fab = InProcessFabric()
    ticks = iter([10.0, 10.5, 20.0, 20.25])
    a, b = fab.endpoint("a"), fab.endpoint("b", clock=lambda: next(ticks))
    abuf, bbuf = a.allocate(BLOCK), b.allocate(BLOCK)
    b.read("a", bbuf.addr, abuf.addr, BLOCK)
    b.write("a", bbuf.addr, abuf.addr, BLOCK)
    assert b.stats.time_s == pytest.approx(0.75)


def test_default_clock_is_the_loop_clock_in_virtual_time():
    async def main():
        fab = InProcessFabric()
        a, b = fab.endpoint("a"), fab.endpoint("b")
        abuf, bbuf = a.allocate(BLOCK), b.allocate(BLOCK)
        b.read("a", bbuf.addr, abuf.addr, BLOCK)
        return b.stats.time_s

    # nothing awaits between the two clock reads: zero virtual time passes
    assert vtime.run(main()) == 0.0
