"""The driver target of a simulated run: each trace turn as a request routed in process.

:class:`SimTarget` takes the driver's :class:`~replayer.driver.TurnRequest`, gives it the turn's block
identities (the token synthesizer's, never token lists: the emulator trusts the hashes), routes it
through the run's :class:`~gateway.router.Router` to an engine, and turns the outcome into the
turn's :class:`~replayer.records.RequestRecord`. Apart from :mod:`replayer.simulate` (which builds
the engines, the router and this target, and runs them in virtual time) because it is the part that
speaks for one request: what the record says, and what happens on the way to the gateway (the live
path's delay, :mod:`replayer.live_path`).

With ``engine_timing`` the record also says what the engine itself saw (its arrival, queue, prefill,
decode: :class:`~replayer.records.EngineTimedRecord`), the columns a live run fills from vLLM's
per-request spans (:mod:`replayer.engine_spans`), so the two can be split alike (:mod:`replayer.gap_split`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

from engines.vllm.protocol import request_max_tokens
from gpuhit.errors import BadRequestError
from replayer.driver import TurnRequest
from replayer.records import EngineTimedRecord, RequestRecord


class SimTarget:
    """Driver target that routes each turn through an in-process :class:`~gateway.router.Router`.

    The record's ``realized_hit_tokens`` is what the serving instance did not compute: its GPU
    prefix hit plus KV imported from a CPU/remote tier, a migration or a fetch (KV computed earlier
    and moved). For PD it is the prefill instance's hit: the KV the decode instance imports was
    computed for this very request, so counting it would report PD's 100% as reuse.
    """

    def __init__(self, router: Any, synth: Any, max_model_len: int | None = None,
                 live_path: Callable[[int], float] | None = None, engine_timing: bool = False):
        from gateway.router import RouteRequest

        self._RouteRequest = RouteRequest
        self.router = router
        self.synth = synth
        # the live path's delay given the requests in flight here (replayer/live_path.py); None: none
        self.live_path = live_path
        self.in_flight = 0
        self.engine_timing = engine_timing
        # As the live gateway does: the smallest engine max_model_len (None: no limit known).
        lens = [m for e in router.engines if isinstance(m := getattr(e, "max_model_len", None), int)]
        self.max_model_len = max_model_len if max_model_len is not None else (min(lens) if lens else None)

    async def submit(self, req: TurnRequest) -> RequestRecord:
        if self.live_path is None:
            return await self._submit(req, asyncio.get_running_loop().time())
        sent = asyncio.get_running_loop().time()
        delay = self.live_path(self.in_flight)
        self.in_flight += 1
        try:
            if delay > 0:
                await asyncio.sleep(delay)  # the path from the client through the gateway, in virtual time
            return await self._submit(req, sent)
        finally:
            self.in_flight -= 1

    async def _submit(self, req: TurnRequest, sent: float) -> RequestRecord:
        loop = asyncio.get_running_loop()
        s, k = req.session, req.turn_index
        turn = s.turns[k]
        try:
            max_tokens, note = request_max_tokens(turn.output_length, turn.input_length, self.max_model_len)
        except BadRequestError as exc:  # refused by the gateway before routing, as vLLM refuses it
            if self.engine_timing:
                return EngineTimedRecord(arrival=sent, finish=sent, input_tokens=turn.input_length, error=str(exc),
                                         rejected=1, engine_missing="refused before the engine")
            return RequestRecord(arrival=sent, finish=sent, input_tokens=turn.input_length, error=str(exc),
                                 rejected=1)
        rr = self._RouteRequest(
            request_id=req.request_id,
            prompt_len=turn.input_length,
            max_tokens=max_tokens,
            block_hashes=self.synth.block_hashes(s, k),
            session_id=s.session_id,
            parent_session=s.parent,
            turn=k,
        )
        routed = await self.router.submit(rr)
        res = routed.result
        d = routed.decision
        if getattr(routed, "pd", False) and routed.producer is not None:
            # PD: the decode instance imports KV the prefill instance has just computed; that is a
            # transfer, not a prefix-cache hit. The request's cache hit is the producer's.
            realized = routed.producer.cached_tokens + routed.producer.external_cached_tokens
        else:
            realized = res.cached_tokens + res.external_cached_tokens
        rec = (EngineTimedRecord if self.engine_timing else RequestRecord)(
            instance=routed.instance,
            action=d.action + ("+fallback" if routed.fallback else ""),
            reason=d.reason,
            arrival=sent,
            first_token=res.first_token_time if res.first_token_time is not None else math.nan,
            finish=res.finish_time if res.finish_time is not None else loop.time(),
            input_tokens=turn.input_length,
            output_tokens=res.completion_tokens,
            predicted_hit_tokens=routed.predicted_hit_tokens,
            realized_hit_tokens=realized,
            error=res.error or "",
            note=note,
            preemptions=res.num_preemptions,
        )
        if self.engine_timing:
            engine_timing(rec, res)  # type: ignore[arg-type]
        return rec


def engine_timing(rec: EngineTimedRecord, res: Any) -> None:
    """Fill ``rec``'s engine columns from an engine result, as vLLM's span reports them (queue: queued
    to first scheduled; prefill: to the first token; decode: to the last; TTFT and e2e from arrival)."""
    queued, scheduled = getattr(res, "queued_time", None), getattr(res, "scheduled_time", None)
    if queued is None or scheduled is None or res.first_token_time is None or res.finish_time is None:
        rec.engine_missing = "the engine did not report its steps" if not res.error else "request failed"
        return
    rec.engine_arrival = res.arrival
    rec.engine_queue = scheduled - queued
    rec.engine_prefill = res.first_token_time - scheduled
    rec.engine_decode = res.finish_time - res.first_token_time
    rec.engine_ttft = res.first_token_time - res.arrival
    rec.engine_e2e = res.finish_time - res.arrival
