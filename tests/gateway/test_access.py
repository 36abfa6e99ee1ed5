"""Access and input checks, through real loopback sockets and both transports: the API key guards
the completions, /v1/models, /debug/state and /reset_prefix_cache (and /metrics with
``metrics_auth``), is checked on the headers before any body byte is read, and comes from the
flag, a file or $GPUHIT_API_KEY; token ids beyond the vocabulary get vLLM's 400; a port in use and
an engine that is down give one line and exit 2 from ``gpuhit serve``."""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import pytest

from engines.fake import FakeEngine
from gateway.cli import api_key
from gateway.http.prompt import vocab_size_of
from gpuhit.errors import ConfigError
from tests.e2e.helpers import gateway, servers, spawn_emulator
from tests.gateway.test_http_fast import completion, read_response, request, urls

BOTH = pytest.mark.parametrize("transport", ["fast", "aiohttp"])
KEY = "s3cret-key"
AUTH = f"Authorization: Bearer {KEY}\r\n"


async def _ask(url: str, data: bytes) -> tuple[int, dict, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    try:
        writer.write(data)
        return await asyncio.wait_for(read_response(reader), 20.0)
    finally:
        writer.close()


def _get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode()


@BOTH
def test_api_key_guards_admin_endpoints_and_is_checked_before_the_body(transport):
    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=transport, api_key=KEY) as (gw, url):
            for path in ("/debug/state", "/v1/models"):
                s, _, b = await _ask(url, _get(path))
                assert s == 401 and json.loads(b)["error"]["type"] == "UnauthorizedError", path
                assert (await _ask(url, _get(path, AUTH)))[0] == 200, path
            s, _, _ = await _ask(url, b"POST /reset_prefix_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            assert s == 401
            for path in ("/health", "/metrics"):  # probes and (by default) metrics stay open
                assert (await _ask(url, _get(path)))[0] == 200, path
            # A wrong key, a key without "Bearer", one byte off.
            for extra in ("Authorization: Bearer nope\r\n", f"Authorization: {KEY}\r\n",
                          f"Authorization: Bearer {KEY}x\r\n"):
                assert (await _ask(url, request(completion([1] * 20), extra=extra)))[0] == 401
            assert (await _ask(url, request(completion([1] * 20), extra=AUTH)))[0] == 200
            # The head announces 50 MB and sends none of it: the 401 comes from the headers alone.
            s, _, _ = await _ask(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                      b"\r\nContent-Length: 50000000\r\n\r\n")
            assert s == 401
            assert gw.router.stats.decisions == 1

    asyncio.run(main())


@BOTH
def test_metrics_auth_flag_guards_metrics(transport):
    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=transport, api_key=KEY, metrics_auth=True) as (_gw, url):
            assert (await _ask(url, _get("/metrics")))[0] == 401
            s, _h, b = await _ask(url, _get("/metrics", AUTH))
            assert s == 200 and b"gpuhit_gateway_requests_total" in b
            assert (await _ask(url, _get("/health")))[0] == 200

    asyncio.run(main())


@BOTH
def test_token_ids_beyond_the_vocabulary_are_rejected(transport, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["X"], "text_config": {"vocab_size": 1000}}))
    assert vocab_size_of(str(tmp_path)) == 1000 == vocab_size_of(str(cfg))

    async def main():
        async with servers([FakeEngine("a")]) as srvs, \
                gateway(urls(srvs), transport=transport, model_config=str(cfg)) as (gw, url):
            assert gw.vocab_size == 1000
            s, _, b = await _ask(url, request(completion([5] * 19 + [1000])))
            err = json.loads(b)["error"]
            assert s == 400 and err["message"] == "Token id 1000 is out of vocabulary"  # vLLM's words
            assert err["param"] == "prompt" and err["type"] == "BadRequestError"
            assert (await _ask(url, request(completion([5] * 19 + [999]))))[0] == 200
            assert gw.router.stats.decisions == 1

    asyncio.run(main())


def test_vocab_size_of_refuses_configs_without_one(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ConfigError, match="names no positive vocab_size"):
        vocab_size_of(str(f))
    with pytest.raises(ConfigError, match="cannot read the model config"):
        vocab_size_of(str(tmp_path / "missing.json"))


def test_api_key_sources_and_the_ps_warning(tmp_path, capsys):
    f = tmp_path / "key"
    f.write_text(" from-file \n")
    env = {"GPUHIT_API_KEY": "from-env"}
    assert api_key(None, str(f), env, "from-config") == "from-file"
    assert api_key(None, None, env, "from-config") == "from-env"
    assert api_key(None, None, {}, "from-config") == "from-config"
    assert api_key(None, None, {}, None) is None
    assert capsys.readouterr().err == ""
    assert api_key("from-flag", str(f), env, None) == "from-flag"
    assert "visible to every user in `ps`" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        api_key(None, str(tmp_path / "empty"), {}, None)
    with pytest.raises(ConfigError, match="--api-key-file"):
        api_key(None, str(tmp_path / "nope"), {}, None)


async def _serve(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "replayer.cli", "serve", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60.0)
    return proc.returncode, out.decode()


def test_serve_port_in_use_engine_down_and_public_bind_warning():
    async def main():
        emu, engine_url = await spawn_emulator()
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        try:
            port = busy.getsockname()[1]
            rc, out = await _serve("--engine", engine_url, "--port", str(port))
            assert rc == 2 and out.strip().count("\n") == 0, out
            assert f"cannot listen on 127.0.0.1:{port}" in out and "Traceback" not in out
            rc, out = await _serve("--engine", "http://127.0.0.1:9", "--port", "0")  # nothing listens on 9
            assert rc == 2 and out.strip().count("\n") == 0, out
            assert "127.0.0.1:9" in out and "Unclosed" not in out
            rc, out = await _serve("--engine", engine_url, "--host", "0.0.0.0", "--port", str(port))
            assert rc == 2 and "without an API key" in out.splitlines()[0]
        finally:
            busy.close()
            await emu.stop()

    asyncio.run(main())


def test_serve_freezes_its_start_up_objects_out_of_the_gc():
    """`gpuhit serve` freezes what exists once it listens (the KV index's block-hash sets among it):
    /debug/state shows the frozen count and the collections per generation."""
    import aiohttp

    from tests.e2e.helpers import spawn

    async def main():
        async with servers([FakeEngine("a")]) as (srv,):
            gw = await spawn(["-m", "replayer.cli", "serve", "--port", "0", "--engine",
                              f"http://127.0.0.1:{srv.port}", "--model", "m"])
            try:
                url = gw.first_line.split(" on ", 1)[1].split(" ", 1)[0]
                async with aiohttp.ClientSession() as http, http.get(url + "/debug/state") as r:
                    state = await r.json()
                assert state["gc"]["frozen"] > 1000 and len(state["gc"]["collections"]) == 3
            finally:
                await gw.stop()

    asyncio.run(main())


def test_limit_and_timeout_settings_are_validated():
    from gateway.config import EngineEntry, GatewayConfig, from_mapping

    base = {"engines": (EngineEntry("http://127.0.0.1:1", "e0"),)}
    for name in ("max_connections", "header_timeout", "body_timeout", "keepalive_timeout", "upstream_idle_timeout"):
        with pytest.raises(ConfigError, match=f"{name} must be positive"):
            GatewayConfig(**base, **{name: 0}).validate()
    for name in ("vocab_size", "upstream_max_idle"):
        with pytest.raises(ConfigError, match=f"{name} must be >= 0"):
            GatewayConfig(**base, **{name: -1}).validate()
    cfg = from_mapping({"gateway": {"metrics_auth": True, "vocab_size": 1000, "header_timeout": 2}})
    assert cfg.metrics_auth and cfg.vocab_size == 1000 and cfg.header_timeout == 2.0
