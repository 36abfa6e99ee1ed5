"""``gpuhit serve``'s process: one :class:`~gateway.http.app.Gateway` on the loop until a signal.

Kept apart from the gateway itself (:mod:`gateway.http.app`), which tests and the live A/B start
and stop in-process: what only the command does (tracing set up for the process, the collector's
freeze once the long-lived state exists, the banner, waiting for SIGINT/SIGTERM) lives here.
"""

from __future__ import annotations

import asyncio
import gc

from gateway.config import GatewayConfig
from gateway.http.app import Gateway
from gpuhit import tracing
from gpuhit.aio import until_signalled


async def serve(cfg: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    """Run the gateway until SIGINT/SIGTERM (used by ``gpuhit serve``)."""
    tracer = tracing.setup("gpuhit-gateway", cfg.otel)
    gw = Gateway(cfg, tracer)
    try:
        port = await gw.listen()
        # What exists now lives as long as the gateway: modules, the router, the KV index's sets of
        # block hashes. Out of the cyclic GC's reach, a full collection no longer walks every hash
        # an engine holds (hundreds of thousands: ~1.5% of a new 2k-token prompt's instructions
        # went to set_traverse) and scales with what requests leave behind instead.
        gc.freeze()
        print(f"gpuhit serve: listening on http://{cfg.host}:{port} ({len(cfg.engines)} engines, policy "
              f"{gw.policy_name}, {cfg.index} index, {cfg.transport} transport"
              f"{', C speedups' if gw.accel is not None else ''})", flush=True)
        if gw.policy_note is not None:
            print(f"gpuhit serve: {gw.policy_note}", flush=True)
        if ready is not None:
            ready.set()
        await until_signalled()
    finally:
        await gw.shutdown()
        tracing.shutdown()


def run(cfg: GatewayConfig) -> None:
    from gpuhit.vtime import run_live

    try:
        run_live(serve(cfg))
    except KeyboardInterrupt:
        pass


__all__ = ["run", "serve"]
