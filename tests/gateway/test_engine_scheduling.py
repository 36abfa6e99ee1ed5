"""The check that a priority policy's engines schedule by priority (gateway/engine_scheduling.py).

Against real vLLM (FCFS and priority engines): tests/e2e/test_real_vllm_priority.py.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from gateway.cli import scheduling_warnings
from gateway.engine_scheduling import check_scheduling, engines_scheduling, policy_scheduling
from gpuhit.errors import ConfigError


def test_which_policies_need_priority_scheduling():
    assert policy_scheduling("lpwl") == "fcfs"
    assert policy_scheduling("lpwl_auto") == "priority"
    assert policy_scheduling({"name": "x", "type": "lpwl_auto", "params": {"priority": "none"}}) == "fcfs"
    assert policy_scheduling("lpwl_resident_prio") == "priority"


def test_known_fcfs_engines_are_refused_unknown_ones_warned():
    with pytest.raises(ConfigError, match=r"http://a \(fcfs\)") as e:
        check_scheduling("lpwl_auto", "priority", {"http://a": "fcfs", "http://b": "priority", "http://c": None})
    assert "http://b" not in str(e.value) and "--scheduling-policy priority" in str(e.value)
    warnings = check_scheduling("lpwl_auto", "priority", {"http://b": "priority", "http://c": None})
    assert len(warnings) == 1 and "http://c" in warnings[0] and "http://b" not in warnings[0]
    assert check_scheduling("lpwl_auto", "priority", {"http://b": "priority"}) == []
    assert check_scheduling("lpwl", "fcfs", {"http://a": "fcfs", "http://c": None}) == []


def test_server_info_is_read_and_its_absence_is_unknown():
    def info(policy: str):
        async def handle(request: web.Request) -> web.Response:
            assert request.query["config_format"] == "json"
            return web.json_response({"vllm_config": {"scheduler_config": {"policy": policy}}})
        return handle

    async def run() -> dict[str, str | None]:
        runners, urls = [], []
        for policy in ("fcfs", "priority", None):
            app = web.Application()
            if policy is not None:  # the last one has no development routes: 404
                app.router.add_get("/server_info", info(policy))
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        try:
            return list((await engines_scheduling(urls)).values())
        finally:
            for r in runners:
                await r.cleanup()

    assert asyncio.run(run()) == ["fcfs", "priority", None]


def test_serve_warns_where_the_engines_cannot_say():
    from engines.vllm.launch import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    warnings = scheduling_warnings("lpwl_resident_prio", [url])
    assert len(warnings) == 1 and url in warnings[0] and "VLLM_SERVER_DEV_MODE" in warnings[0]
    assert scheduling_warnings("lpwl", [url]) == []  # asks nothing when the policy sets no priority
