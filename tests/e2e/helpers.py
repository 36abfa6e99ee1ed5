"""Loopback fixtures for live-path tests: emulated servers and a gateway on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

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
    from gpuhit import speedups

    kw.setdefault("accel", speedups.load())  # as `gpuhit emulate` builds them: the C chain where it is built
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


TRANSPORT_ENV = "GPUHIT_GATEWAY_TRANSPORT"


@contextlib.asynccontextmanager
async def gateway(urls: Sequence[str], tracer: Any = None, roles: Sequence[str] | None = None,
                  name_prefix: str = "e", **kw: Any) -> AsyncIterator[tuple[Gateway, str]]:
    """A gateway on a free loopback port in front of ``urls`` (engines e0, e1, ... or another
    ``name_prefix``). The transport
    is ``kw["transport"]``, else $GPUHIT_GATEWAY_TRANSPORT (run every live test against either
    implementation), else the config's default."""
    roles = roles or ["both"] * len(urls)
    # No live test may hang on a stuck upstream: fail (or fall back) clearly after a minute.
    kw.setdefault("timeout", 60.0)
    # lpwl unless a test names another (policy=None: the default, decided by the engines' scheduling)
    kw.setdefault("policy", "lpwl")
    if "transport" not in kw and os.environ.get(TRANSPORT_ENV):
        kw["transport"] = os.environ[TRANSPORT_ENV]
    cfg = GatewayConfig(engines=tuple(EngineEntry(u, f"{name_prefix}{i}", role=r) for i, (u, r) in enumerate(zip(urls, roles))),
                        **kw).validate()
    gw = Gateway(cfg, tracer)
    try:
        port = await gw.listen("127.0.0.1", 0)
        yield gw, f"http://127.0.0.1:{port}"
    finally:
        await gw.shutdown()


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
    p = await spawn(["-m", "replayer.cli", "emulate", "--port", "0", "--model", "m", *extra], env=env)
    url = p.first_line.split(" on ", 1)[1].split(" ", 1)[0]
    return p, url


def zero_cost_profile(name: str = "qwen3-coder-30b-a3b@h20"):
    """The profile with every step / frontend / transfer cost at 0 s (live tests and benchmarks:
    the engine answers as fast as its HTTP server can)."""
    import dataclasses

    from engines.emulated.profile import load_profile

    p = load_profile(name)
    zero = {f.name: 0.0 for f in dataclasses.fields(p)
            if f.name.endswith("_s") and isinstance(getattr(p, f.name), float)}
    return dataclasses.replace(p, **zero)


@contextlib.asynccontextmanager
async def emulated(names: Sequence[str], num_gpu_blocks: int = 512, **kw: Any) -> AsyncIterator[list[Any]]:
    """Zero-cost in-process ``EmulatedEngine`` s (closed on exit)."""
    from engines.emulated.engine import EmulatedEngine

    engines = [EmulatedEngine(n, zero_cost_profile(), num_gpu_blocks=num_gpu_blocks, model_name="m", **kw)
               for n in names]
    try:
        yield engines
    finally:
        for e in engines:
            await e.close()


def sse_events(text: str) -> list[tuple[str, dict]]:
    """A named-event SSE stream (Anthropic Messages, OpenAI Responses) as (event, data) pairs."""
    out = []
    for chunk in text.split("\n\n"):
        if chunk.strip():
            ev, data = chunk.split("\n", 1)
            out.append((ev.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out
