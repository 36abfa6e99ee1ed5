"""Move the KV, not the work: the price of migrating a session's prefix instead of recomputing it.

When a GPU-hit-first policy sends a turn away from the instance holding its prefix (the holder's
queue is long, or keeping the session there overflows its HBM), the target recomputes the whole
prefix the holder had: ``T(input - hit_t, hit_t)``, ~34 s for 100k tokens on the H20 profile. The
gateway's two-step KV move (``MIGRATE``: a producer step on the holder exports the prompt's KV,
the target imports it and decodes; ``gateway/ticket.py``) replaces that recompute with

* the producer step's wait in the holder's queue: it is an ordinary request there, sent at the
  turn's own priority (so it overtakes nobody the turn itself would not), priced as the holder's
  queued prefill work;
* the holder's prefill of the prompt's tail it does not hold (``T(input - hit_h, hit_h)``), which
  also delays the holder's ``in_flight`` requests, as any prefill there would;
* the transfer of the prompt's KV over the link (:func:`policies.costmodel.kv_transfer_s`, the
  NIC the *GPU-Hit-First* note measured, 9.7 GB/s, 96 KiB per token): ~1 s per 100k tokens.

The target sees the turn only once the KV has arrived (the router runs the producer step, then
sends the turn to the target), so the turn then waits in the target's queue as well: the chain and
the target's queued prefill add up. And the holder's copy stays pinned (vLLM's
``delay_free_blocks``) until the target admits the turn and pulls it, so a move to a target with a
queue ties up HBM on both instances for that queue's length, evicting other sessions' prefixes on
the holder, which nothing in the snapshot prices. A move is therefore priced only to a target with
no prefill queued (it admits the turn at its next step); elsewhere :func:`migrate_work` says None.
All in prefill-work tokens (time over the profile's ``a``), the unit ``lpwl_auto`` prices everything
in (``policies/adaptive.py``). Pure: a function of the snapshot, nothing else.
"""

from __future__ import annotations

from policies.costmodel import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_PROFILE,
    FABRICS,
    kv_transfer_s,
    prefill_work_tokens,
)
from policies.snapshot import InstanceState, Snapshot

_LINK = FABRICS["nic"]


def transfer_work_tokens(tokens: int) -> int:
    """Moving ``tokens`` tokens of KV over the link, in prefill-work tokens (time over ``a``)."""
    return round(kv_transfer_s(tokens, _LINK, DEFAULT_KV_BYTES_PER_TOKEN) / DEFAULT_PROFILE.a)


def holder(snapshot: Snapshot) -> InstanceState | None:
    """The healthy instance holding the longest GPU prefix of this request (ties: lower index), or
    None when no instance holds any."""
    best = None
    for s in snapshot.instances:
        if s.healthy and s.gpu_hit_blocks > 0 and (best is None or s.gpu_hit_blocks > best.gpu_hit_blocks):
            best = s
    return best


def migrate_work(snapshot: Snapshot, src: InstanceState, dst: InstanceState) -> int | None:
    """Time to first token on ``dst`` (work tokens, the module docstring's chain) when ``src``'s
    prefix KV is moved there, plus the delay its tail prefill adds to ``src``'s in-flight requests;
    None when ``src`` holds no more of the prompt than ``dst`` (nothing to move) or ``dst`` has
    prefill queued (the module docstring)."""
    if src.index == dst.index or dst.pending_prefill_work > 0:
        return None
    hit_s, hit_d = snapshot.hit_tokens(src.index), snapshot.hit_tokens(dst.index)
    if hit_s <= hit_d:
        return None
    n = snapshot.request.input_tokens
    tail = prefill_work_tokens(n - hit_s, hit_s)
    chain = src.pending_prefill_work + tail + transfer_work_tokens(n)
    return chain + dst.pending_prefill_work + tail * src.in_flight
