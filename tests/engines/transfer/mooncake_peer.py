"""Peer process for the two-process Mooncake test (run as a script, not collected by pytest).

argv: n_blocks block_bytes seed. Allocates n_blocks x block_bytes of registered memory filled with
``random.Random(seed).randbytes``, prints one JSON line ``{"address", "addr"}`` on stdout, then
answers JSON commands on stdin: ``{"op": "dump", "offset", "length"}`` -> ``{"hex": ...}``;
``{"op": "exit"}`` ends it. Synchronisation is this pipe, never a sleep.
"""

from __future__ import annotations

import json
import random
import sys

from engines.transfer.mooncake import MooncakeTransfer


def main() -> int:
    n_blocks, block, seed = (int(x) for x in sys.argv[1:4])
    t = MooncakeTransfer("127.0.0.1")
    buf = t.allocate(n_blocks * block)
    t.write_local(buf.addr, random.Random(seed).randbytes(n_blocks * block))
    print(json.dumps({"address": t.address, "addr": buf.addr}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "dump":
            data = t.read_local(buf.addr + cmd["offset"], cmd["length"])
            print(json.dumps({"hex": data.hex()}), flush=True)
        elif cmd["op"] == "exit":
            break
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
