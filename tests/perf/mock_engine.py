"""A zero-latency mock vLLM engine for router benchmarks (``python tests/perf/mock_engine.py``).

Why not ``gpuhit emulate --zero-cost``: the emulator schedules every prompt through its KV manager,
which on a small machine would dominate the latency and steal the routers' CPU. This mock answers a
canned OpenAI completion / chat completion at once (4 tokens, a ``usage`` with ``cached_tokens``),
streamed as SSE chunks or whole, and serves what both routers read at start-up: ``/health``,
``/v1/models``, ``/metrics`` (``vllm:cache_config_info`` with the block size) and
``/kv_event_sources``.

It does publish KV events as vLLM 0.32 does (its wire shape, :data:`engines.kv_event_encode.VLLM`), so a KV-aware router's precise index holds what the
engines hold and its lookups, lazy hashing included, do the work they do in production: every
token-id prompt's full blocks (vLLM's sha256 block hashes, :mod:`engines.hashing`) not stored yet
are announced in one ``BlockStored`` event, with a ``BlockRemoved`` for the least recently used
blocks beyond its capacity (``--capacity``, default 1,000,000 blocks; with ``--removed per-block``
one ``BlockRemoved`` per evicted block, as vLLM 0.32's block pool sends them). As vLLM 0.32's
scheduler does once per engine step (``Scheduler.update_from_output``: one ``KVEventBatch`` of the step's events, published before
the step's outputs go out), the events of the requests answered in one event-loop iteration (this
mock's "step") go out as one batch on the ZMQ PUB socket, and only then their answers
(``--events per-request``: a batch per request, published before its answer, as earlier versions
of this mock did). Prints ``mock engine on http://127.0.0.1:<port>`` once listening.

It is kept cheap, because on the benchmark's machine it shares the cores with the routers it
measures (an engine in production runs on its own host): a new 100k-token prompt costs it ~6.5 ms of
CPU in process (its sha256 block hashes in C with ``make compile``, a lazily kept LRU, the event's
token ids packed in numpy), where it cost ~19 ms, which at c=64 made the 100k rows a measure of the
mock's own throughput. The benchmark prints the engines' CPU per request with each row.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from itertools import repeat

import httptools
import numpy as np
import orjson

from engines.hashing import BlockHasher, SessionHashCache
from engines.kv_event_encode import VLLM, encode_batch, encode_seq
from engines.kv_events import BlockRemoved, BlockStored, KVEventBatch
from gateway.http.prompt import FAST_PARSE_MIN_BYTES, fast_completion_ids
from gpuhit import speedups

BLOCK_SIZE = 16
OUT = 4
CAPACITY = 1_000_000  # blocks (16M tokens: the agentic workload's 64 sessions of 100k fit), as /metrics' num_gpu_blocks says


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


def _answers(kv_port: int, capacity: int = CAPACITY) -> dict[bytes, bytes]:
    metrics = (f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}",num_gpu_blocks="{capacity}"}} 1.0\n'
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


# A BlockStored's token ids spliced into the encoded batch: the events are encoded with an empty
# ``token_ids`` (this map key then an empty array, bytes that nothing else in a batch holds: no key
# or string ends in "token_ids" and a hash's 8 bytes are too few) and each is replaced by its ids.
_EMPTY_TOKENS = b"\xa9token_ids\x90"
_TOKENS_KEY = b"\xa9token_ids"


_LIMITS = (128, 256, 1 << 16, 1 << 32)  # the smallest ids of uint8, uint16, uint32, uint64
_TYPE_BYTE = np.array([0, 0xCC, 0xCD, 0xCE, 0xCF], dtype=np.uint8)
_WIDTH = np.array([0, 1, 2, 4, 8], dtype=np.uint8)  # bytes after the type byte, by type code


def msgpack_uints(ids: np.ndarray) -> bytes:
    """``msgpack.packb(ids.tolist())`` for unsigned integers, in whole-array passes: each id in its
    smallest form (positive fixint, uint8/16/32/64 with a type byte and big-endian bytes), as msgpack
    packs a Python int (100k ids below 2**32 in ~2 ms, against ~4.5 ms to make and pack their Python ints)."""
    v = np.asarray(ids, dtype=np.uint64)
    n = len(v)
    head = bytes([0x90 | n]) if n < 16 else (b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16
                                              else b"\xdd" + n.to_bytes(4, "big"))
    if n == 0:
        return head
    # every id in a row of a type byte and its big-endian bytes (4, or 8 if any id needs them), then
    # one compress keeps the type byte (the value itself for a fixint) and the id's last 0/1/2/4/8
    code = sum((v >= limit).view(np.uint8) for limit in _LIMITS)  # 0 fixint, 1 uint8 ... 4 uint64
    nbytes = 8 if code.max() == 4 else 4
    rows = np.empty((n, 1 + nbytes), dtype=np.uint8)
    rows[:, 1:] = v.astype(f">u{nbytes}").view(np.uint8).reshape(n, nbytes)
    rows[:, 0] = np.where(code == 0, rows[:, nbytes], _TYPE_BYTE[code])
    width = _WIDTH[code]
    keep = np.empty((n, 1 + nbytes), dtype=bool)
    keep[:, 0] = True
    for col in range(1, 1 + nbytes):  # big-endian: column col holds the id's (nbytes + 1 - col)th last byte
        np.greater_equal(width, nbytes + 1 - col, out=keep[:, col])
    out = np.compress(keep.ravel(), rows.ravel())
    return head + out.tobytes()


class _Store:
    """What this engine has cached (LRU, ``capacity`` blocks), and the PUB socket it announces
    stored and evicted blocks on (the evicted in one ``BlockRemoved`` a prompt, or with
    ``removed_per_block`` one each, as vLLM).

    The LRU is kept lazily, for speed (this mock shares the machine's cores with the routers it
    measures): each prompt is one *use* that stamps all its blocks, hits and new ones, in order; the
    uses are queued oldest first, and eviction walks them from the front, taking a block only where
    the use it is listed under is still its latest. That is the order an OrderedDict gives with
    every hit moved to the end and the new blocks appended (tests/engines/test_bench_mock_engine.py
    holds the two to each other), at a dict store a block instead of a linked-list node."""

    def __init__(self, pub, per_step: bool = True, capacity: int = CAPACITY, removed_per_block: bool = False) -> None:
        self.pub = pub
        self.seq = 0
        self.per_step = per_step
        self.capacity = capacity
        self.removed_per_block = removed_per_block
        self.events: list = []  # this step's events, not published yet
        self.token_ids: list[np.ndarray] = []  # this step's BlockStored token ids, in event order
        self.answers: list[tuple[asyncio.Transport, bytes]] = []  # this step's answers, not written yet
        self._flush: asyncio.Handle | None = None
        # few sessions kept: a kept 100k-token prompt costs ~1.4 MB, and every prompt is kept once
        self.hashes = SessionHashCache(BlockHasher(BLOCK_SIZE, accel=speedups.load()), max_sessions=128,
                                       max_tokens=4 << 20)
        self.stamp: dict[int, int] = {}  # cached block -> the latest use of it
        self.uses: deque[tuple[int, list[int]]] = deque()  # (use, its blocks), oldest first
        self.listed = 0  # blocks listed in self.uses, stale ones included
        self.use = 0

    def on_prompt(self, body: bytes, session: str | None) -> None:
        """Queue for this step's batch the prompt's full blocks that are not cached yet (token-id
        prompts only), and the least recently used blocks they push out."""
        if len(body) >= FAST_PARSE_MIN_BYTES and (fast := fast_completion_ids(body)) is not None:
            ids = fast[1]
        else:
            try:
                prompt = orjson.loads(body).get("prompt")
            except (orjson.JSONDecodeError, AttributeError):
                return
            if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
                return
            ids = np.array(prompt, dtype=np.uint64)
        hs = list(self.hashes.hashes_array(ids, session))
        if not hs:
            return
        stamp = self.stamp
        k = next((j for j, h in enumerate(hs) if h not in stamp), len(hs))
        self.use += 1
        stamp.update(zip(hs, repeat(self.use)))  # a hit refreshes its blocks; the new are added after
        self.uses.append((self.use, hs))
        self.listed += len(hs)
        if k == len(hs):
            if self.listed > 2 * len(stamp) + 65536:
                self._compact()
            return
        evicted = self._evict(len(stamp) - self.capacity)
        # as vLLM 0.32 fills them (medium, group 0, data-parallel rank 0) and encodes them (VLLM)
        self.events.append(BlockStored(tuple(hs[k:]), hs[k - 1] if k else None, (), BLOCK_SIZE,
                                       medium="GPU", group_idx=0))
        self.token_ids.append(ids[k * BLOCK_SIZE : len(hs) * BLOCK_SIZE])
        if evicted and self.removed_per_block:
            self.events.extend(BlockRemoved((h,), medium="GPU", group_idx=0) for h in evicted)
        elif evicted:
            self.events.append(BlockRemoved(tuple(evicted), medium="GPU", group_idx=0))

    def _evict(self, n: int) -> list[int]:
        """The ``n`` least recently used blocks, taken out of the cache."""
        out: list[int] = []
        stamp, uses = self.stamp, self.uses
        while len(out) < n:
            use, hs = uses.popleft()
            self.listed -= len(hs)
            for j, h in enumerate(hs):
                if stamp.get(h) == use:
                    if len(out) == n:  # the rest of this use stays, oldest still
                        uses.appendleft((use, hs[j:]))
                        self.listed += len(hs) - j
                        break
                    del stamp[h]
                    out.append(h)
        return out

    def _compact(self) -> None:
        """Drop the listings of blocks used again since (hit-only prompts add listings, no blocks)."""
        stamp = self.stamp
        self.uses = deque((use, live) for use, hs in self.uses if (live := [h for h in hs if stamp.get(h) == use]))
        self.listed = len(stamp)

    def answer(self, transport: asyncio.Transport, data: bytes) -> None:
        """Write ``data`` after this step's events are published (at once when per request)."""
        if not self.per_step:
            self.publish()
            transport.write(data)
            return
        self.answers.append((transport, data))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self.end_step)

    def end_step(self) -> None:
        self._flush = None
        self.publish()
        answers, self.answers = self.answers, []
        for transport, data in answers:
            if not transport.is_closing():
                transport.write(data)

    def publish(self) -> None:
        if self.events:
            self.pub.send_multipart([b"kv-events", encode_seq(self.seq), self.payload()])
            self.seq += 1

    def payload(self) -> bytes:
        """This step's events as vLLM 0.32 encodes them (:func:`encode_batch`, shape VLLM), taken."""
        batch = KVEventBatch(time.time(), tuple(self.events), 0)
        token_ids, self.events, self.token_ids = self.token_ids, [], []
        parts = encode_batch(batch, VLLM).split(_EMPTY_TOKENS)
        if len(parts) != len(token_ids) + 1:
            raise RuntimeError(f"{len(parts) - 1} empty token-id arrays in a batch of {len(token_ids)} BlockStored")
        out = [parts[0]]
        for ids, rest in zip(token_ids, parts[1:]):
            out += (_TOKENS_KEY, msgpack_uints(ids), rest)
        return b"".join(out)


class _Conn(asyncio.Protocol):
    def __init__(self, answers: dict[bytes, bytes], store: _Store):
        self.answers = answers
        self.store = store
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.session: str | None = None

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
        self.session = None

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-session-id":
            self.session = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        key = self.url
        if key.endswith(b"completions"):
            body = b"".join(self.body)
            self.store.on_prompt(body, self.session)
            if b'"stream":true' in body or b'"stream": true' in body:
                key += b"+s"
        self.store.answer(self.transport, self.answers.get(key, NOT_FOUND))


async def main(port: int, per_step: bool = True, capacity: int = CAPACITY, removed_per_block: bool = False) -> None:
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    kv_port = pub.bind_to_random_port("tcp://127.0.0.1")
    answers = _answers(kv_port, capacity)
    loop = asyncio.get_running_loop()
    store = _Store(pub, per_step, capacity, removed_per_block)
    server = await loop.create_server(lambda: _Conn(answers, store), "127.0.0.1", port, backlog=1024)
    print(f"mock engine on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--events", choices=("per-step", "per-request"), default="per-step",
                    help="one KV event batch per event-loop iteration, as vLLM per engine step (default), "
                         "or one per request")
    ap.add_argument("--capacity", type=int, default=CAPACITY, help="blocks of KV cache (LRU beyond it)")
    ap.add_argument("--removed", choices=("per-prompt", "per-block"), default="per-prompt",
                    help="the blocks a prompt evicts in one BlockRemoved (default), or one BlockRemoved per "
                         "block, as vLLM 0.32 sends them")
    import uvloop

    args = ap.parse_args()
    uvloop.run(main(args.port, args.events == "per-step", args.capacity, args.removed == "per-block"))
