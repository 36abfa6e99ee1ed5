"""The fault-injection replay (tests/e2e/fault_replay.py): a closed-loop replay through a real
gateway over two real ``gpuhit emulate`` processes while a schedule kills and quickly restarts
one, wedges the other (SIGSTOP / SIGCONT), drops a KV-event connection, kills an engine for a
while and slows one (a SIGSTOP / SIGCONT duty cycle giving it a tenth of its time). Every request
ends ok or with a clear error within its budget, no predicted hit exceeds the realized one, the
replay completes, the slow engine is kept while it makes progress, and the report counts each
fault and what it cost."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.e2e import fault_replay as fr
from tests.e2e.helpers import gateway

TTFB = IDLE = 4.0
STALL = 1.0
# The clear errors a fault may cost a request: its engine died or was ejected under it.
CLEAR = ("died mid-stream", "was ejected while this request was in flight", "unreachable at",
         "closed the connection", "no healthy instance")


@pytest.mark.timeout(150)
def test_faults_cost_one_window_each_and_no_phantom_hits():
    kw = {"policy": "lpwl", "health_interval": 0.2, "ttfb_timeout": TTFB, "idle_timeout": IDLE,
          "stall_timeout": STALL, "breaker_cooldown": 0.5, "breaker_max_cooldown": 2.0, "timeout": 60.0}
    res = asyncio.run(fr.run(gateway, kw))
    recs, events, rep = res["records"], res["events"], res["report"]
    print(json.dumps(rep, indent=1))
    # The replay completed: every fault ran, and the sessions went on through and after them.
    assert [e.fault.kind for e in events] == [f.kind for f in fr.SCHEDULE]
    last_fault_end = max(e.end for e in events)
    assert sum(1 for r in recs if r.ok and r.arrival > last_fault_end) >= 10
    assert sum(1 for r in recs if r.ok) >= 0.8 * len(recs)
    # Every request ended ok or with a clear error, within its budget (each turn streams).
    for r in recs:
        assert r.ok or any(c in r.error for c in CLEAR), r.error
        assert r.finish - r.arrival < TTFB + IDLE * (r.output_tokens or 1), r
    # No phantom hit: the index of a restarted engine (or one whose KV connection dropped) never
    # predicted a hit the engine did not have.
    phantom = [r for r in recs if r.ok and r.predicted_hit_tokens > r.realized_hit_tokens]
    assert not phantom, [(r.instance, r.arrival, r.predicted_hit_tokens, r.realized_hit_tokens) for r in phantom]
    assert sum(r.predicted_hit_tokens for r in recs if r.ok) > 0  # hits were predicted at all
    # The report counts each fault and what it cost; the wedge cost one stall window, not a budget.
    by_kind = {f["fault"]: f for f in rep}
    assert set(by_kind) == set(fr.KINDS)
    wedge = by_kind[fr.WEDGE]
    assert wedge["requests_affected"] >= 1 and wedge["worst_wait_s"] < TTFB
    assert all(f["phantom_hits"] == 0 for f in rep)
    # A slow engine that keeps making progress is not a stall: it stays in (no ejection) and its
    # requests all end ok; only their wait grows (reported as its mean beside the calm requests').
    slow = by_kind[fr.SLOW]
    assert slow["requests_affected"] >= 1 and slow["failed"] == 0 and slow["ejections"] == 0, slow
    # Ejections are counted at all: the wedge (no byte for the stall window) was ejected.
    assert wedge["ejections"] >= 1, wedge
