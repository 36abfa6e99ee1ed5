"""Whether the engines schedule by the request priorities the gateway's policy sets.

A policy such as ``lpwl_auto`` (``priority: saved``) or ``lpwl_resident_prio`` forwards vLLM's
per-request ``priority``; only an engine started with ``--scheduling-policy priority`` orders its
queue by it. vLLM 0.32 accepts the field under its default ``fcfs`` too and then ignores it without a
word (the API's field description says a non-zero priority raises an error; no code path checks it:
the FCFS queue of ``vllm/v1/core/sched/request_queue.py`` never reads it), so a priority policy in
front of FCFS engines silently becomes another policy. The check runs once, before the gateway
serves.

vLLM names its scheduling policy only on its development route ``GET /server_info``
(``VLLM_SERVER_DEV_MODE=1``, which experiments set anyway for ``/reset_prefix_cache``), in
``vllm_config.scheduler_config.policy``. An engine without the route, or not reachable yet, is
*unknown*: the caller warns and serves, since a deployment may have started its engines right.

The same answer picks the default policy when none is configured (:func:`default_policy`):
``lpwl_auto``, the policy the project recommends for any trace, with its priorities (``priority:
saved``) where every engine is known to schedule by them, else with ``priority: none``. Its placement
is the same either way; a priority that an engine would ignore, or that nobody can confirm it
follows, is not sent, and the gateway says which it chose and why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpuhit.errors import ConfigError

#: the policy a gateway configured with none runs (:func:`default_policy`)
DEFAULT_POLICY = "lpwl_auto"

# /server_info also collects the host's environment on its first call (vLLM's collect_env): seconds.
SERVER_INFO_TIMEOUT = 60.0


def policy_scheduling(policy: str | Mapping[str, Any] | Any) -> str:
    """The vLLM ``--scheduling-policy`` a gateway policy needs: ``priority`` when it sets request
    priorities, else ``fcfs``."""
    from policies.registry import build

    pol = build(policy) if isinstance(policy, (str, Mapping)) else policy
    return str(getattr(pol, "scheduling_policy", "fcfs"))


async def engine_scheduling(http: Any, url: str) -> str | None:
    """The engine's scheduling policy as ``/server_info`` reports it; None when it cannot say (no
    development route, not reachable, another server)."""
    import aiohttp

    try:
        async with http.get(url.rstrip("/") + "/server_info", params={"config_format": "json"},
                            timeout=aiohttp.ClientTimeout(total=SERVER_INFO_TIMEOUT)) as r:
            if r.status != 200:
                return None
            doc = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    try:
        policy = doc["vllm_config"]["scheduler_config"]["policy"]
    except (KeyError, TypeError):
        return None
    return policy if isinstance(policy, str) else None


async def engines_scheduling(urls: Sequence[str], http: Any = None) -> dict[str, str | None]:
    """:func:`engine_scheduling` of every engine, asked together (on ``http``, else a session of
    its own)."""
    import asyncio

    import aiohttp

    if http is None:
        async with aiohttp.ClientSession() as own:
            return await engines_scheduling(urls, own)
    got = await asyncio.gather(*(engine_scheduling(http, u) for u in urls))
    return dict(zip(urls, got))


def default_policy(found: Mapping[str, str | None]) -> tuple[dict[str, Any], str]:
    """The policy a gateway configured with none runs, and the line that says why (module
    docstring): ``lpwl_auto`` with priorities where every engine in ``found`` (url -> its scheduling
    policy, None if unknown) runs ``priority``, else ``lpwl_auto`` with ``priority: none``."""
    if found and all(p == "priority" for p in found.values()):
        note = "policy lpwl_auto (the default; priority: saved): every engine runs --scheduling-policy priority"
        return {"name": DEFAULT_POLICY, "type": DEFAULT_POLICY, "params": {}}, note
    fcfs = [f"{u} ({p})" for u, p in found.items() if p is not None and p != "priority"]
    unknown = [u for u, p in found.items() if p is None]
    why = []
    if fcfs:
        why.append(f"engines under another scheduling policy would ignore them: {', '.join(fcfs)}")
    if unknown:
        why.append(f"could not read the scheduling policy of {', '.join(unknown)} (GET /server_info needs "
                   "VLLM_SERVER_DEV_MODE=1)")
    note = (f"policy lpwl_auto (the default) without request priorities (priority: none): {'; '.join(why)}; engines started "
            "with --scheduling-policy priority and VLLM_SERVER_DEV_MODE=1 get them (gpuhit vllm-cmd does both)")
    return {"name": DEFAULT_POLICY, "type": DEFAULT_POLICY, "params": {"priority": "none"}}, note


def check_scheduling(policy_name: str, needed: str, found: Mapping[str, str | None]) -> list[str]:
    """Raise :class:`ConfigError` when an engine is known to run another scheduling policy than the
    one ``policy_name`` needs (``needed``: :func:`policy_scheduling`); the warnings to print for
    engines that could not say. A policy that sets no priority runs on either."""
    if needed == "fcfs":
        return []
    wrong = [f"{u} ({p})" for u, p in found.items() if p is not None and p != needed]
    if wrong:
        raise ConfigError(
            f"policy {policy_name!r} sets request priorities, which vLLM follows only under --scheduling-policy "
            f"{needed}; these engines run another and would ignore them: {', '.join(wrong)}. Restart them with "
            f"--scheduling-policy {needed}, or choose a policy without priorities (e.g. lpwl_auto with priority: none)")
    unknown = [u for u, p in found.items() if p is None]
    if not unknown:
        return []
    return [(f"policy {policy_name!r} sets request priorities; could not read the scheduling policy of "
            f"{', '.join(unknown)} (GET /server_info needs VLLM_SERVER_DEV_MODE=1): make sure they run with "
            f"--scheduling-policy {needed}, or vLLM ignores the priorities without an error")]
