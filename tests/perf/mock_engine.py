"""A zero-latency mock vLLM engine for router benchmarks (``python tests/perf/mock_engine.py``).

Why not ``gpuhit emulate --zero-cost``: the emulator parses every prompt and hashes its blocks (a
100k-token prompt costs it tens of ms of CPU), so on a small machine it would dominate the latency
and steal the routers' CPU. This mock never parses a body: it reads it, looks for ``"stream":true``
and answers a canned OpenAI completion / chat completion (4 tokens, a ``usage`` with
``cached_tokens``), streamed as SSE chunks or whole. It serves what both routers read at start-up:
``/health``, ``/v1/models``, ``/metrics`` (``vllm:cache_config_info`` with the block size) and
``/kv_event_sources`` (a ZMQ PUB socket that never publishes: the gateway's precise index
subscribes and stays empty). Prints ``mock engine on http://127.0.0.1:<port>`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import orjson

BLOCK_SIZE = 16
OUT = 4


def _completion(chat: bool) -> bytes:
    choice = ({"index": 0, "message": {"role": "assistant", "content": " a b c d"}, "finish_reason": "length"}
              if chat else {"index": 0, "text": " a b c d", "finish_reason": "length"})
    return orjson.dumps({
        "id": "cmpl-mock", "object": "chat.completion" if chat else "text_completion", "created": 0, "model": "m",
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": OUT, "total_tokens": 1 + OUT,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    })


def _stream(chat: bool) -> bytes:
    obj = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for k in range(OUT):
        choice = {"index": 0, "delta": {"content": " a"}} if chat else {"index": 0, "text": " a"}
        events.append({"id": "cmpl-mock", "object": obj, "created": 0, "model": "m", "choices": [choice]})
    events.append({"id": "cmpl-mock", "object": obj, "created": 0, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 1, "completion_tokens": OUT, "total_tokens": 1 + OUT,
                             "prompt_tokens_details": {"cached_tokens": 0}}})
    out = b""
    for e in events:
        data = b"data: " + orjson.dumps(e) + b"\n\n"
        out += b"%x\r\n%s\r\n" % (len(data), data)
    done = b"data: [DONE]\n\n"
    return out + b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)


def _whole(status: bytes, ctype: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _answers(kv_port: int) -> dict[bytes, bytes]:
    metrics = (f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",num_gpu_blocks="100000"}} 1.0\n'
               'vllm:num_requests_running{model_name="m"} 0.0\nvllm:num_requests_waiting{model_name="m"} 0.0\n'
               'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n').encode()
    sse_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return {
        b"/health": _whole(b"200 OK", b"text/plain", b""),
        b"/v1/models": _whole(b"200 OK", b"application/json", orjson.dumps(
            {"object": "list", "data": [{"id": "m", "object": "model", "root": "m", "max_model_len": 1 << 20}]})),
        b"/metrics": _whole(b"200 OK", b"text/plain; version=0.0.4", metrics),
        b"/kv_event_sources": _whole(b"200 OK", b"application/json", orjson.dumps(
            {"0": {"endpoint": f"tcp://127.0.0.1:{kv_port}", "replay_endpoint": None, "topic": "kv-events"}})),
        b"/v1/completions": _whole(b"200 OK", b"application/json", _completion(False)),
        b"/v1/completions+s": sse_head + _stream(False),
        b"/v1/chat/completions": _whole(b"200 OK", b"application/json", _completion(True)),
        b"/v1/chat/completions+s": sse_head + _stream(True),
    }


NOT_FOUND = _whole(b"404 Not Found", b"application/json", b'{"error":"not found"}')


class _Conn(asyncio.Protocol):
    def __init__(self, answers: dict[bytes, bytes]):
        self.answers = answers
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport):  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url.split(b"?", 1)[0]
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        key = self.url
        if key.endswith(b"completions"):
            body = b"".join(self.body)
            if b'"stream":true' in body or b'"stream": true' in body:
                key += b"+s"
        self.transport.write(self.answers.get(key, NOT_FOUND))


async def main(port: int) -> None:
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    kv_port = pub.bind_to_random_port("tcp://127.0.0.1")
    answers = _answers(kv_port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(answers), "127.0.0.1", port, backlog=1024)
    print(f"mock engine on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--port", type=int, default=0)
    import uvloop

    uvloop.run(main(ap.parse_args().port))
