"""What the emulated server reports about itself, in vLLM 0.32's shapes: the ``/v1/models`` card,
the ``/metrics`` text (with vLLM's ``cache_config_info``, where the gateway reads the block size)
and the ``/kv_event_sources`` description of its ZMQ publisher.

Kept apart from :mod:`engines.emulated.server`, which serves requests: these are pure functions
of the engine's state and the server's settings.
"""

from __future__ import annotations

import uuid
from typing import Any

from engines.vllm.kv_events_publisher import KVEventPublisher

BUFFER_STEPS = 10_000  # KV-event replay buffer (steps) and ZMQ send high-water mark: vLLM's defaults
HWM = 100_000


def model_card(model: str, root: str | None, max_model_len: int | None, created: int) -> dict[str, Any]:
    """vLLM's ``/v1/models`` answer: one card for the served model."""
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
        "group": None, "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root or model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}


def metrics_text(engine: Any, block_size: int, model: str) -> str:
    """The Prometheus text of ``/metrics``: the engine's vLLM-named families (or, for an engine
    without them, the gauges routing reads) plus vLLM's ``cache_config_info``."""
    from prometheus_client import ProcessCollector
    from prometheus_client.core import GaugeMetricFamily

    from engines.emulated.metrics import render

    st = engine.stats()
    # vLLM's cache_config_info info-gauge: block size and pool size ride in its labels.
    info = {"block_size": str(block_size), "engine": "0", "num_gpu_blocks": str(st.kv_capacity_blocks or 0),
            "enable_prefix_caching": "True"}
    cache_info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=list(info))
    cache_info.add_metric(list(info.values()), 1.0)
    # the serving process's CPU seconds, as vLLM's API server exports them (prometheus_client's process
    # collector on its default registry): what `gpuhit profile fit` reads as the frontend's CPU
    process = [f for f in ProcessCollector(registry=None).collect() if f.name == "process_cpu_seconds"]
    m = getattr(engine, "metrics", None)
    if m is not None:
        return m.render_prometheus([cache_info, *process])
    fams = []  # an engine without vLLM metrics (e.g. engines.fake)
    for name, v in (("vllm:num_requests_running", st.running), ("vllm:num_requests_waiting", st.waiting),
                    ("vllm:kv_cache_usage_perc", st.kv_usage)):
        f = GaugeMetricFamily(name, name, labels=["engine", "model_name"])
        f.add_metric(["0", model], float(v or 0))
        fams.append(f)
    return render([*fams, cache_info, *process])


def advertised(endpoint: str | None, host: str) -> str | None:
    """``endpoint`` with ``host`` in place of the bound address."""
    if endpoint is None:
        return None
    # LAST_ENDPOINT of a wildcard bind reads tcp://0.0.0.0:P; clients need a reachable host.
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


def describe_kv_sources(publisher: KVEventPublisher, host: str, topic: str) -> dict[str, dict[str, Any]]:
    """vLLM 0.32's ``/kv_event_sources``: the KV-events config of each data-parallel rank, keyed by rank."""
    return {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": advertised(publisher.endpoint_bound, host),
            "replay_endpoint": advertised(publisher.replay_endpoint_bound, host),
            "buffer_steps": BUFFER_STEPS,
            "hwm": HWM,
            # vLLM's engine-to-publisher queue bound; the emulator publishes in-line (no queue)
            "max_queue_size": HWM,
            "topic": topic,
        }
    }


__all__ = ["BUFFER_STEPS", "HWM", "advertised", "describe_kv_sources", "metrics_text", "model_card"]
