"""``/kv_event_sources`` answers as real vLLM 0.32 gives them (object keyed by DP rank) and the older
array form, ``*`` replaced by the engine's host."""

from __future__ import annotations

import pytest

from engines.vllm.client import parse_kv_sources
from gpuhit.errors import EngineError

VLLM_032 = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
                  "topic": "kv-events"}}


def test_vllm_object_form_with_wildcards():
    assert parse_kv_sources(VLLM_032, "http://10.0.0.7:8000") == [
        {"data_parallel_rank": 0, "endpoint": "tcp://10.0.0.7:5557", "replay_endpoint": "tcp://10.0.0.7:5558",
         "topic": "kv-events"}]


def test_ranks_sorted_disabled_ones_left_out():
    doc = {"1": {**VLLM_032["0"], "endpoint": "tcp://*:5559", "replay_endpoint": None},
           "0": VLLM_032["0"], "2": {**VLLM_032["0"], "enable_kv_cache_events": False}}
    got = parse_kv_sources(doc, "http://h:1")
    assert [(s["data_parallel_rank"], s["endpoint"], s["replay_endpoint"]) for s in got] == [
        (0, "tcp://h:5557", "tcp://h:5558"), (1, "tcp://h:5559", None)]


def test_array_form_and_explicit_hosts_kept():
    doc = [{"data_parallel_rank": 0, "endpoint": "tcp://127.0.0.1:9", "replay_endpoint": "tcp://0.0.0.0:10",
            "topic": ""}]
    assert parse_kv_sources(doc, "http://[::1]:8000") == [
        {"data_parallel_rank": 0, "endpoint": "tcp://127.0.0.1:9", "replay_endpoint": "tcp://[::1]:10", "topic": ""}]


@pytest.mark.parametrize("doc", [{}, [], {"0": {"publisher": "zmq"}}, "x",
                                 {"0": {**VLLM_032["0"], "publisher": "null"}}])
def test_unusable_answers_are_clear_errors(doc):
    with pytest.raises(EngineError, match="kv_event_sources"):
        parse_kv_sources(doc, "http://h:1")
