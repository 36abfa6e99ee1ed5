"""The real-vLLM ground: the shipped tiny model serves token-id, text and chat requests, reports
cached prompt tokens per block of 32, and publishes its KV-event sources (vLLM 0.32's shape)."""

from __future__ import annotations

import json
import urllib.request


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_tiny_model_serves_and_reports_cached_tokens(real_vllm_pair):
    url = real_vllm_pair.urls[0]
    prompt = list(range(1000, 1100))  # 100 tokens = 3 full blocks of 32
    first = _post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    again = _post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert first["usage"]["prompt_tokens"] == 100
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    chat = _post(url + "/v1/chat/completions",
                 {"model": "tiny", "messages": [{"role": "user", "content": "route the query"}], "max_tokens": 2})
    assert chat["usage"]["completion_tokens"] == 2
    models = _get(url + "/v1/models")
    assert models["data"][0]["max_model_len"] == real_vllm_pair.max_model_len


def test_kv_event_sources_shape(real_vllm_pair):
    srv = real_vllm_pair.servers[1]
    sources = _get(srv.url + "/kv_event_sources")
    assert isinstance(sources, dict) and set(sources) == {"0"}
    assert sources["0"]["endpoint"] == f"tcp://*:{srv.kv_events_port}"
    assert sources["0"]["replay_endpoint"] == f"tcp://*:{srv.kv_events_port + 1}"


def test_real_vllm_event_batches_take_the_typed_and_the_c_decoder(real_vllm_pair, monkeypatch, c_speedups):
    """vLLM's own payloads (read back through its replay socket) decode on msgspec's typed decoder,
    token ids left raw, and equal what the untyped reference makes of them; the C decoder takes
    every one of them (no fallback) and gives the same batches, merged or not."""
    import msgpack
    import zmq

    from engines import kv_event_codec as codec
    from engines.kv_events import BlockStored
    from engines.kv_raw_token_ids import RawTokenIds

    srv = real_vllm_pair.servers[0]
    prompt = list(range(3000, 3000 + 32 * 5 + 7))
    _post(srv.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(f"tcp://127.0.0.1:{srv.kv_events_port + 1}")
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads = []
        while True:
            frames = sock.recv_multipart()
            if frames[-2] == b"\xff" * 8:
                break
            payloads.append(frames[-1])
    finally:
        sock.close()
        ctx.term()
    stored = []
    for p in payloads:
        fast = codec._decode_current(p)
        assert fast is not None, msgpack.unpackb(p)  # vLLM 0.32's shape fits the typed structs
        with monkeypatch.context() as m:
            m.setattr(codec, "_decode_current", lambda _p: None)
            assert fast == codec.decode_batch(p)  # the general decoder: the same records
        for merge in (False, True):
            decoder = codec.BatchDecoder(c_speedups)
            assert decoder.decode(p, merge) == codec.decode_batch(p, merge) and decoder.fallbacks == 0
        stored += [e for e in fast.events if type(e) is BlockStored]
    ours = [e for e in stored if tuple(e.token_ids[:32]) == tuple(prompt[:32])]
    assert ours and all(type(e.token_ids) is RawTokenIds for e in stored)
    assert sum(len(e.block_hashes) for e in ours) >= 5
