"""Loopback fixtures for live-path tests: emulated servers and a gateway on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from aiohttp import web

from engines.emulated.server import EmulatedServer
from gateway.config import EngineEntry, GatewayConfig
from gateway.http.app import Gateway


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``cond`` on the loop (yielding to I/O) until true; fail clearly after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)  # yield to the sockets; not a synchronization sleep


@contextlib.asynccontextmanager
async def servers(engines: Sequence[Any], model: str = "m", **kw: Any) -> AsyncIterator[list[EmulatedServer]]:
    out = []
    try:
        for eng in engines:
            srv = EmulatedServer(eng, model=model, **kw)
            await srv.start()
            out.append(srv)
        yield out
    finally:
        for srv in out:
            await srv.close()


@contextlib.asynccontextmanager
async def gateway(urls: Sequence[str], tracer: Any = None, **kw: Any) -> AsyncIterator[tuple[Gateway, str]]:
    cfg = GatewayConfig(engines=tuple(EngineEntry(u, f"e{i}") for i, u in enumerate(urls)), **kw).validate()
    gw = Gateway(cfg, tracer)
    runner = web.AppRunner(gw.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield gw, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


class Proc:
    """A child process whose first stdout line we parse (port); killed on exit."""

    def __init__(self, proc: asyncio.subprocess.Process, first_line: str):
        self.proc = proc
        self.first_line = first_line

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


async def spawn(args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 30.0) -> Proc:
    import os
    import sys

    full_env = {**os.environ, **(env or {})}
    proc = await asyncio.create_subprocess_exec(sys.executable, *args, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, env=full_env)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
    except TimeoutError:
        proc.kill()
        raise AssertionError(f"{args} printed nothing within {timeout} s") from None
    if not line:
        rest = await proc.stdout.read()
        raise AssertionError(f"{args} exited: {rest.decode(errors='replace')[-2000:]}")
    return Proc(proc, line.decode().strip())


async def spawn_emulator(*extra: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    """``gpuhit emulate --port 0`` in a child process; returns it and its base URL."""
    p = await spawn(["-m", "gpuhit.cli", "emulate", "--port", "0", "--model", "m", *extra], env=env)
    url = p.first_line.split(" on ", 1)[1].split(" ", 1)[0]
    return p, url
