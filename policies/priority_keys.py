"""The vLLM priorities ``lpwl_auto`` sends: keys of each engine's waiting queue, bounded overtaking.

Under ``--scheduling-policy priority`` a vLLM engine admits its waiting requests in the order of
``(priority, arrival)``, lower first, and preempts the highest key first when blocks run out; stock
vLLM takes any integer. Every key here is an integer number of milliseconds on the gateway's clock,
so comparing two keys compares two instants, and "how far can a request be overtaken" is a time.

* ``aged``: ``max(session_start, now - service)``. Program-level FCFS (Continuum, arXiv
  2511.02230) keeps an older session's continuation turn ahead of newer work, so it runs before
  its prefix is evicted while it waits; the credit over a request arriving at the same moment is
  capped at one observed median service time, as Autellix (arXiv 2502.13965) promotes a program
  whose wait grows large against its service time.
* ``saved`` (the default): ``max(aged key, now - T(hit))``, ``T(hit)`` the cost model's time to
  recompute the request's predicted GPU prefix hit on its target (:class:`PrefillProfile`: ~34 s
  for a 100k-token context, 0.1 s for 2k): a turn overtakes newer work by no longer than the
  recompute its running early avoids. Why this second cap: with ``aged`` alone, where the service
  time is long (overload: minutes) a first turn waits behind every continuation arriving within
  that window on its instance, however little each has cached, and new sessions carry the tail.
* ``finish``: the ``saved`` key plus ``T(own)``, the cost model's time of this request's own
  prefill on its target (the new tokens after its predicted hit): the instant its prefill would
  end if it started at its ``saved`` key, earliest first. Among requests of equal credit that is
  shortest-prefill-first, the order that minimises the mean wait of a single server (Smith's
  rule, WSPT with equal weights; Dynamo's router releases its queue by ``wspt``), and the shift
  is the request's own size, so nobody is overtaken without bound.

Bounds (``C(q) = min(service, T(hit_q))`` the credit a request ``q`` may take, 0 for a first
turn, which holds no prefix; ``P(r)`` the prefill time of ``r``): under ``saved`` a request ``r``
arriving at ``t`` is overtaken only by requests arriving before ``t + C(q)``; under ``finish``
only by those arriving before ``t + P(r) + C(q) - P(q)``, i.e. by at most its own prefill time
more than under ``saved``. A first turn of a reuse-free trace is overtaken only by later first
turns with a shorter prefill, arriving within its own prefill time.

Where a key acts at all: only where an engine's waiting queue holds a request past a schedule that
admits others (admission bound by free KV blocks or ``max_num_seqs``), or where blocks run out and
a running request is preempted. With chunked prefill a waiting request is admitted as soon as the
step's token budget has room for one chunk of it, so where prompts are far below the budget and KV
is plentiful (the Azure conversation trace: ~1.2k-token prompts, 8,192-token steps) every schedule
admits the whole queue, and no key changes what runs: ``finish`` there gives ``saved``'s records
exactly, so it cannot lower that trace's mean; where queues do form (WEKA) it moved the median down
and the p99 up, neither significantly, and let ``linear_dynamo`` ahead on p99 at 1.3x knee, so it is
not the default (``analysis/results/policy-engine-queue-order-2026-11-27.md``).

Range: the gateway clock's milliseconds plus at most the prefill of the longest context an engine
accepts (~2 minutes for 196k tokens), far inside the signed 64-bit range vLLM's API accepts.
"""

from __future__ import annotations

from policies.costmodel import DEFAULT_PROFILE
from policies.snapshot import Snapshot

#: the ``priority`` modes of ``lpwl_auto`` (``none``: no priority, engines under FCFS;
#: ``session_start``: the uncapped program-level FCFS of ``lpwl_resident_prio``)
PRIORITIES = ("aged", "saved", "finish", "session_start", "none")
AGING = ("p50", "p90")


def aged_priority(snapshot: Snapshot, aging: str = "p50") -> int:
    """``max(session_start, now - service)`` in integer milliseconds, ``service`` the observed median
    (``aging`` p50) or 90th percentile (p90) service time; the arrival before the first finish."""
    now = snapshot.now
    start = now if snapshot.session_started_at is None else snapshot.session_started_at
    service = snapshot.observed_service_s if aging == "p50" else snapshot.observed_service_p90_s
    key = now if service is None else max(start, now - service)
    return round(1000.0 * key)


def saved_priority(snapshot: Snapshot, hit_tokens: int, aging: str = "p50") -> int:
    """:func:`aged_priority` whose credit is also capped by the recompute time of the request's
    predicted prefix hit on its target (``hit_tokens``): ``max(session_start, now - service,
    now - T(hit))`` in integer milliseconds."""
    now = snapshot.now
    key = aged_priority(snapshot, aging) / 1000.0
    saved = DEFAULT_PROFILE.time(hit_tokens) if hit_tokens > 0 else 0.0
    return round(1000.0 * max(key, now - saved))


def finish_priority(snapshot: Snapshot, hit_tokens: int, aging: str = "p50") -> int:
    """:func:`saved_priority` plus the request's own prefill time on its target, ``T(input - hit
    new tokens after hit cached)``, in integer milliseconds (module docstring: earliest finish)."""
    new = max(0, snapshot.request.input_tokens - hit_tokens)
    own = DEFAULT_PROFILE.time(new, hit_tokens)
    return saved_priority(snapshot, hit_tokens, aging) + round(1000.0 * own)
