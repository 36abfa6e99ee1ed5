"""The gateway's default policy: ``lpwl_auto``, its priorities only where the engines schedule by them.

A gateway configured with no policy asks every engine's ``/server_info`` (vLLM's development route;
the emulated server answers it too) and runs ``lpwl_auto`` with ``priority: saved`` where every engine
runs ``--scheduling-policy priority``, else with ``priority: none``, and says which and why
(gateway/engine_scheduling.py). Against real vLLM: tests/e2e/test_real_vllm_priority.py.
"""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.config import GatewayConfig, from_mapping
from gateway.engine_scheduling import default_policy
from policies.registry import build
from tests.e2e.helpers import gateway, spawn_emulator


def test_priorities_only_where_every_engine_schedules_by_them():
    spec, note = default_policy({"http://a": "priority", "http://b": "priority"})
    assert build(spec).priority == "saved" and "priority: saved" in note
    spec, note = default_policy({"http://a": "priority", "http://b": "fcfs", "http://c": None})
    pol = build(spec)
    assert pol.type == "lpwl_auto" and pol.priority == "none" and pol.scheduling_policy == "fcfs"
    assert "another scheduling policy would ignore them: http://b (fcfs)" in note and "could not read the scheduling policy of http://c" in note
    assert "http://a" not in note
    _, note = default_policy({"http://c": None})
    assert "VLLM_SERVER_DEV_MODE=1" in note and "would ignore" not in note


def test_no_policy_configured_means_the_default():
    assert GatewayConfig().policy is None
    assert from_mapping({"engines": [{"url": "http://a:1"}]}).policy is None
    assert from_mapping({"gateway": {"policy": "lpwl"}}).policy == "lpwl"


async def _default_through(flags: list[tuple[str, ...]]) -> tuple[object, str | None, int]:
    procs = [await spawn_emulator("--zero-cost", *f) for f in flags]
    try:
        async with (gateway([u for _, u in procs], policy=None) as (gw, url),
                    aiohttp.ClientSession() as http):
            body = {"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 2}
            async with http.post(url + "/v1/completions", json=body, headers={"x-session-id": "s"}) as r:
                status = r.status
            return gw.policy, gw.policy_note, status
    finally:
        for p, _ in procs:
            await p.stop()


def test_engines_under_priority_get_lpwl_auto_with_priorities():
    pol, note, status = asyncio.run(_default_through([("--scheduling-policy", "priority")] * 2))
    assert pol.type == "lpwl_auto" and pol.priority == "saved" and status == 200
    assert note is not None and "every engine runs --scheduling-policy priority" in note


def test_one_fcfs_engine_turns_the_priorities_off_and_says_so():
    pol, note, status = asyncio.run(_default_through([("--scheduling-policy", "priority"), ()]))
    assert pol.type == "lpwl_auto" and pol.priority == "none" and status == 200
    assert note is not None and "another scheduling policy would ignore them" in note and "(fcfs)" in note
