"""Carrying a routing decision out in-process, as the simulator does: begin, act, finish.

The live HTTP proxy streams bytes itself and reports to its :class:`~gateway.ticket.Ticket`; a
simulation (and any in-process caller) has no proxy, so :func:`run_routed` plays both parts: it asks
the router for a ticket, runs the KV two-step's producer step on the source when the action moves
KV, runs the request on the target and settles the ticket, whatever happens in between. Kept apart
from :mod:`gateway.router`, which decides and accounts, so the router holds no engine calls.
"""

from __future__ import annotations

import inspect
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engines.base import EngineClient, GenerateResult
from gateway.ticket import RouteRequest, Ticket
from policies.snapshot import FETCH, MIGRATE, PD, Decision


@dataclass(slots=True)
class RoutedResult:
    """Outcome of :func:`run_routed` (``Router.submit``)."""

    decision: Decision
    result: GenerateResult  # the step that produced the client's tokens
    instance: str  # name of the instance that produced them
    predicted_hit_tokens: int
    migrated: bool = False
    fetched: bool = False
    pd: bool = False
    fallback: bool = False  # a KV-moving action whose producer failed: recomputed on the target
    producer: GenerateResult | None = None


class Routes(Protocol):
    """What :func:`run_routed` needs of the router (named here so this module does not import
    :mod:`gateway.router`, which calls it)."""

    engines: tuple[EngineClient, ...]
    names: tuple[str, ...]

    def begin_held(self, req: RouteRequest) -> Ticket | Coroutine[Any, Any, Ticket]: ...


def accepts_on_progress(engine: EngineClient) -> bool:
    """Whether ``engine.generate`` reports progress (then the first token is known when it comes,
    not only at the end)."""
    try:
        return "on_progress" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


async def run_routed(router: Routes, req: RouteRequest, progress_ok: Sequence[bool]) -> RoutedResult:
    """Route and run ``req``: (hold) -> begin -> (producer step) -> target -> finish. ``progress_ok[i]``:
    :func:`accepts_on_progress` of engine ``i``."""
    t = router.begin_held(req)
    if not isinstance(t, Ticket):  # a hold queue: wait for the turn
        t = await t
    producer: GenerateResult | None = None
    try:
        params = None
        if t.needs_producer:
            assert t.source is not None
            try:
                producer = await router.engines[t.source].generate(t.producer_request())
            except Exception as exc:  # noqa: BLE001 - engines return errors; a raising one must not leak counters
                t.producer_done(None, f"{type(exc).__name__}: {exc}")
            else:
                params = t.producer_done(producer)
        result = await _run_target(router.engines[t.target], t, params, progress_ok[t.target])
    except BaseException as exc:
        t.finish(None, f"{type(exc).__name__}: {exc}")
        raise
    t.finish(result)
    return RoutedResult(
        decision=t.decision,
        result=result,
        instance=router.names[t.target],
        predicted_hit_tokens=t.predicted_hit_tokens,
        migrated=t.action == MIGRATE and not t.fallback,
        fetched=t.action == FETCH and not t.fallback,
        pd=t.action == PD and not t.fallback,
        fallback=t.fallback,
        producer=producer,
    )


async def _run_target(eng: EngineClient, t: Ticket, params: Mapping[str, Any] | None,
                      progress: bool) -> GenerateResult:
    greq = t.consumer_request(params)
    if progress:

        def on_progress(n: int) -> None:
            if n >= 1:
                t.first_token()

        result = await eng.generate(greq, on_progress=on_progress)  # type: ignore[call-arg]
    else:
        result = await eng.generate(greq)
    if result.ok:
        t.first_token()  # engines without progress reports: first token known only at the end
    return result


__all__ = ["RoutedResult", "Routes", "accepts_on_progress", "run_routed"]
