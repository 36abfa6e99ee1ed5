"""The compiled request path (gpuhit/native.py): the stale-build guard, and a real mypyc build
serving requests in a gateway process."""

from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest

from engines.fake import FakeEngine
from gpuhit import native
from gpuhit.errors import ConfigError
from tests.e2e.helpers import servers, spawn, spawn_emulator

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so


def _fake_build(root: Path) -> None:
    """Sources, one (empty) extension file per module plus the runtime, and a matching stamp."""
    for m in native.MODULES:
        src = root / m
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {m}\n")
        src.with_suffix(SUFFIX).write_bytes(b"")
    (root / native.RUNTIME_DIR / f"{native.GROUP}__mypyc{SUFFIX}").write_bytes(b"")
    (root / native.RUNTIME_DIR / native.STAMP).write_text(
        json.dumps({m: native.sha256_of(root / m) for m in native.MODULES}))


def test_a_stale_or_partial_build_is_refused_by_name(tmp_path):
    assert native.check(tmp_path) is False  # no build: pure Python
    _fake_build(tmp_path)
    assert native.check(tmp_path) is True
    (tmp_path / "gateway/router.py").write_text("# edited after the build\n")
    with pytest.raises(ConfigError, match=r"gateway/router\.py changed since it was compiled: run `make compile`"):
        native.check(tmp_path)
    _fake_build(tmp_path)
    (tmp_path / f"engines/hashing{SUFFIX}").unlink()
    with pytest.raises(ConfigError, match=r"partial compiled build under .* \(no engines/hashing\.py\)"):
        native.check(tmp_path)
    _fake_build(tmp_path)
    (tmp_path / native.RUNTIME_DIR / f"{native.GROUP}__mypyc{SUFFIX}").unlink()
    with pytest.raises(ConfigError, match=r"\(no gateway/http/compiled__mypyc\.py\)"):
        native.check(tmp_path)
    _fake_build(tmp_path)
    (tmp_path / native.RUNTIME_DIR / native.STAMP).unlink()
    with pytest.raises(ConfigError, match="without a readable gateway/http/native.sha256.json"):
        native.check(tmp_path)
    native.clean(tmp_path)
    assert native.check(tmp_path) is False and not list(tmp_path.rglob("*.so"))
    # a module compiled by a build of another version, which MODULES no longer names
    (tmp_path / "engines/kv_event_codec.py").write_text("# not compiled now\n")
    (tmp_path / f"engines/kv_event_codec{SUFFIX}").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"compiled modules from another build under .* \(engines/kv_event_codec\."):
        native.check(tmp_path)
    native.clean(tmp_path)
    assert native.check(tmp_path) is False and not list(tmp_path.rglob("*.so"))


@pytest.mark.skipif(importlib.util.find_spec("mypyc") is None or shutil.which("cc") is None,
                    reason="needs mypy's mypyc and a C compiler (pip install 'gpuhit[native]')")
def test_a_compiled_gateway_serves_requests(tmp_path):
    """mypyc compiles the request path in a copy of the packages; a gateway run from that copy says
    so in its banner, imports the extensions, and relays a non-streamed and a streamed completion
    from a real engine server with its decision headers; in front of an engine process publishing
    real ZMQ KV events, its precise index (the C speedups' BlockSet) predicts exactly the prefix
    hit the engine then reports."""
    copy = tmp_path / "src"
    for pkg in ("gpuhit", "gateway", "engines", "policies", "replayer", "analysis"):
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.sha256.json"))
    out = subprocess.run([sys.executable, "-m", "gpuhit.native", "build"], cwd=copy, capture_output=True, text=True, check=False,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert all((copy / m).with_suffix(SUFFIX).is_file() for m in native.MODULES)
    assert len(list((copy / native.RUNTIME_DIR).glob(f"{native.GROUP}__mypyc.*.so"))) == 1
    assert len(list((copy / "gpuhit").glob("_speedups.*.so"))) == 1
    boot = (f"import runpy, sys; sys.path.insert(0, {str(copy)!r}); "
            "runpy.run_module('replayer.cli', run_name='__main__', alter_sys=True)")

    async def main():
        async with servers([FakeEngine("a")]) as (srv,):
            gw = await spawn(["-c", boot, "serve", "--port", "0", "--engine", f"http://127.0.0.1:{srv.port}",
                              "--model", "m"])
            try:
                assert "fast transport, compiled, C speedups)" in gw.first_line, gw.first_line
                url = gw.first_line.split(" on ", 1)[1].split(" ", 1)[0]
                async with aiohttp.ClientSession() as http:
                    body = {"model": "m", "prompt": list(range(1, 40)), "max_tokens": 3}
                    async with http.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200 and r.headers["x-gpuhit-instance"] == "e0"
                        assert (await r.json())["usage"]["completion_tokens"] == 3
                    async with http.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                        assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
                        assert (await r.read()).rstrip().endswith(b"data: [DONE]")
                    # a 20 KB token-id prompt: parsed by the C speedups (bodies from 4 KB), and a
                    # corrupt one refused as the pure-Python gateway refuses it
                    big = {**body, "prompt": list(range(1000, 5000))}
                    async with http.post(url + "/v1/completions", json=big) as r:
                        assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == 4000
                    bad = orjson.dumps(big).replace(b",4999]", b",-4999]")
                    async with http.post(url + "/v1/completions", data=bad,
                                         headers={"content-type": "application/json"}) as r:
                        assert r.status == 400 and "prompt" in (await r.json())["error"]["message"]
            finally:
                await gw.stop()
        eng, eng_url = await spawn_emulator("--kv-events-port", "0", "--zero-cost", "--num-gpu-blocks", "4096")
        gw = None
        try:
            gw = await spawn(["-c", boot, "serve", "--port", "0", "--engine", eng_url, "--model", "m",
                              "--policy", "lpwl", "--index", "precise"])
            assert "precise index, fast transport, compiled, C speedups)" in gw.first_line, gw.first_line
            url = gw.first_line.split(" on ", 1)[1].split(" ", 1)[0]
            prompt = {"model": "m", "prompt": list(range(7000, 7320)), "max_tokens": 2}  # 20 blocks of 16
            async with aiohttp.ClientSession() as http:
                async def hits() -> tuple[int, int]:
                    async with http.post(url + "/v1/completions", json=prompt) as r:
                        assert r.status == 200, await r.text()
                        cached = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
                        return int(r.headers["x-gpuhit-predicted-hit"]), cached
                assert await hits() == (0, 0)
                seen: list[tuple[int, int]] = []
                for _ in range(400):  # until the prompt's BlockStored event has reached the index
                    seen.append(await hits())
                    if seen[-1][0]:
                        break
                assert seen[-1] == (304, 304), seen[-5:]  # 19 full blocks (the last token is recomputed)
                assert all(cached == 304 for _, cached in seen)  # the engine had them from the first answer
        finally:
            if gw is not None:
                await gw.stop()
            await eng.stop()

    asyncio.run(main())
