"""A real two-process Mooncake TCP transfer on loopback: KV blocks move byte-exact, both directions.

Process A (``mooncake_peer.py``) owns blocks of known random bytes; this process (B) reads a
scattered subset into its own registered buffer and writes fresh blocks back, and A reports what
landed. Skipped only when the Mooncake engine cannot be imported (reason in the skip message).
"""

from __future__ import annotations

import json
import pathlib
import random
import subprocess
import sys

import pytest

from engines.transfer.mooncake import mooncake_available
from gpuhit.errors import BadRequestError, TransferError

_OK, _WHY = mooncake_available()
pytestmark = [pytest.mark.mooncake, pytest.mark.skipif(not _OK, reason=_WHY)]

ROOT = pathlib.Path(__file__).resolve().parents[3]
PEER = pathlib.Path(__file__).with_name("mooncake_peer.py")
N_BLOCKS, BLOCK, SEED = 32, 4096, 1234  # 32 blocks of 4 KiB (a 16-token KV block of a small model)


@pytest.fixture
def peer(tmp_path):
    err = open(tmp_path / "peer.stderr", "wb")  # noqa: SIM115 - closed in finally; Mooncake logs to stderr; keep it off the pipe
    proc = subprocess.Popen(
        [sys.executable, str(PEER), str(N_BLOCKS), str(BLOCK), str(SEED)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
    )
    try:
        hello = json.loads(proc.stdout.readline())

        def ask(cmd: dict) -> dict:
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
            return json.loads(proc.stdout.readline())

        yield hello["address"], hello["addr"], ask
    finally:
        if proc.poll() is None:
            proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
            proc.stdin.flush()
            proc.wait(timeout=30)
        err.close()


def test_blocks_move_byte_exact_both_ways(peer):
    from engines.transfer.mooncake import MooncakeTransfer

    address, remote_base, ask = peer
    expected = random.Random(SEED).randbytes(N_BLOCKS * BLOCK)
    me = MooncakeTransfer("127.0.0.1")
    try:
        local = me.allocate(N_BLOCKS * BLOCK)
        # read a scattered set of remote blocks into shuffled local slots (one batch)
        remote_ids = [3, 0, 17, 31, 8, 9]
        local_ids = [5, 1, 2, 30, 12, 0]
        pairs = [(local.addr + li * BLOCK, remote_base + ri * BLOCK) for li, ri in zip(local_ids, remote_ids)]
        me.read_blocks(address, pairs, BLOCK)
        for li, ri in zip(local_ids, remote_ids):
            assert me.read_local(local.addr + li * BLOCK, BLOCK) == expected[ri * BLOCK : (ri + 1) * BLOCK]
        # a single read and a single write
        me.read(address, local.addr + 7 * BLOCK, remote_base + 4 * BLOCK, BLOCK)
        assert me.read_local(local.addr + 7 * BLOCK, BLOCK) == expected[4 * BLOCK : 5 * BLOCK]
        fresh = random.Random(99).randbytes(3 * BLOCK)
        me.write_local(local.addr + 20 * BLOCK, fresh)
        me.write_blocks(address, [(local.addr + (20 + i) * BLOCK, remote_base + (10 + 2 * i) * BLOCK) for i in range(3)], BLOCK)
        for i in range(3):
            got = bytes.fromhex(ask({"op": "dump", "offset": (10 + 2 * i) * BLOCK, "length": BLOCK})["hex"])
            assert got == fresh[i * BLOCK : (i + 1) * BLOCK]
        # untouched neighbours on the peer are unchanged
        assert bytes.fromhex(ask({"op": "dump", "offset": 11 * BLOCK, "length": BLOCK})["hex"]) == expected[11 * BLOCK : 12 * BLOCK]
        s = me.stats
        assert (s.reads, s.bytes_read) == (7, 7 * BLOCK)
        assert (s.writes, s.bytes_written) == (3, 3 * BLOCK)
        assert s.failures == 0 and s.bytes_moved == 10 * BLOCK

        # wrong peer: a clear TransferError, counted, nothing else changes
        with pytest.raises(TransferError, match=r"read from 127\.0\.0\.1:1 failed"):
            me.read("127.0.0.1:1", local.addr, remote_base, BLOCK)
        assert me.stats.failures == 1 and me.stats.bytes_read == 7 * BLOCK
        # a local range outside registered memory is refused before native code sees it
        with pytest.raises(BadRequestError, match="not inside a buffer"):
            me.read(address, local.addr + N_BLOCKS * BLOCK, remote_base, BLOCK)
    finally:
        me.close()
