"""How the simulator's cost grows with the cluster: simulated requests per CPU-second and sim/wall
for 8, 32 and 128 emulated instances at block sizes 16 and 64 (a benchmark: not collected by CI).

Sessions scale with the instances so that the load per instance stays the same: the bundled WEKA
slice (20 conversations for 8 instances) is copied ``instances / 8`` times, each copy in its own
hash namespace (no reuse across copies, as across real conversations), and the Poisson session rate
is multiplied by the same factor. One policy (lpwl_resident, the GPU-hit-first family's workhorse),
one seed. CPU seconds are the process's own (``time.process_time``), so a loaded machine stretches
the wall time but not the requests per CPU-second.

    PYTHONPATH=. python tests/perf/test_sim_scaling.py            # prints the markdown table
    PYTHONPATH=. python tests/perf/test_sim_scaling.py 128x64 128x16   # only these rows
    PYTHONPATH=. python -m pytest -s tests/perf/test_sim_scaling.py

Each row also gives the machine's 1-minute load average at its start and end: on a shared machine
CPU seconds are inflated by contention too, so only rows measured under similar load compare.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest

from replayer.loaders import bundled_path, load_trace
from replayer.simulate import simulate
from replayer.trace import Trace

INSTANCES = (8, 32, 128)
BLOCK_SIZES = (16, 64)
BASE_RATE = 1.0 / 60.0  # gpuhit replay's default session rate for 8 instances


def scaled_trace(trace: Trace, copies: int) -> Trace:
    """``copies`` copies of ``trace``, each in its own namespace with its own session ids."""
    sessions = []
    for c in range(copies):
        for s in trace.sessions:
            sessions.append(dataclasses.replace(
                s, session_id=f"{s.session_id}#{c}", namespace=f"{s.namespace}#{c}",
                parent=None if s.parent is None else f"{s.parent}#{c}"))
    return dataclasses.replace(trace, name=f"{trace.name}x{copies}", sessions=tuple(sessions))


def measure(instances: int, block_size: int) -> dict[str, float]:
    base = load_trace(bundled_path("weka")).trace
    copies = instances // 8
    trace = scaled_trace(base, copies)
    load0 = os.getloadavg()[0]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    res = simulate(trace, "lpwl_resident", instances=instances, seed=0, arrival="poisson",
                   session_rate=BASE_RATE * copies, max_think_time=60.0, progress=False, block_size=block_size,
                   engine_kwargs={"block_size": block_size})
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = len(res.records)
    return {"instances": instances, "block_size": block_size, "conversations": 20 * copies, "requests": n,
            "cpu_s": cpu, "wall_s": wall, "req_per_cpu_s": n / cpu, "sim_wall": res.makespan / wall,
            "makespan_s": res.makespan, "load": f"{load0:.0f}-{os.getloadavg()[0]:.0f}"}


def table(rows: list[dict[str, float]]) -> str:
    out = ["| instances | block | conversations | requests | CPU s | wall s | requests / CPU-s | sim/wall | load |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        out.append(f"| {r['instances']} | {r['block_size']} | {r['conversations']} | {r['requests']:,} | "
                   f"{r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['req_per_cpu_s']:,.0f} | {r['sim_wall']:,.0f}x | "
                   f"{r['load']} |")
    return "\n".join(out)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("instances", INSTANCES)
def test_sim_scaling(instances, block_size):
    r = measure(instances, block_size)
    print("\n" + table([r]))
    assert r["requests"] == 2357 * (instances // 8)


if __name__ == "__main__":
    wanted = [tuple(map(int, a.split("x"))) for a in sys.argv[1:]] or [(n, bs) for bs in BLOCK_SIZES
                                                                       for n in INSTANCES]
    rows = []
    for n, bs in wanted:
        rows.append(measure(n, bs))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
