"""The publishing end of KV events over ZMQ (PUB + ROUTER replay), as vLLM's ``ZmqEventPublisher``
speaks them: the emulated server's side. The wire protocol and the subscribing end are in
:mod:`engines.vllm.kv_events_zmq`.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import zmq
import zmq.asyncio

from engines.kv_event_encode import END_SEQ, VLLM, encode_batch, encode_seq
from engines.kv_events import KVEventBatch

log = logging.getLogger(__name__)


class KVEventPublisher:
    """PUB + ROUTER replay publisher of KV event batches (the emulated engine's side).

    ``endpoint`` / ``replay_endpoint`` are ZMQ bind addresses (``tcp://127.0.0.1:0`` picks a free
    port; :attr:`endpoint_bound` / :attr:`replay_endpoint_bound` tell which). Publishing is
    synchronous and non-blocking (PUB drops at the high-water mark, exactly like vLLM); replay
    requests are served by a task on the running loop, started by :meth:`start`.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        shape: str = VLLM,
        data_parallel_rank: int = 0,
    ):
        self._ctx = zmq.asyncio.Context()
        self._topic = topic.encode()
        self._shape = shape
        self._rank = data_parallel_rank
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._seq = 0
        self._lose = 0
        # XPUB is PUB on the wire (vLLM subscribers see no difference) but also reports
        # subscriptions, which lets callers wait until a subscriber is really attached.
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint_bound: str = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint_bound: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint_bound = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._task: asyncio.Task | None = None
        self._sub_task: asyncio.Task | None = None
        self.subscriptions = 0
        self._subscribed: asyncio.Condition | None = None
        self.topic = topic

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._replay is not None and self._task is None:
            self._task = loop.create_task(self._serve_replay(), name="kv-replay")
        if self._sub_task is None:
            self._subscribed = asyncio.Condition()
            self._sub_task = loop.create_task(self._watch_subscriptions(), name="kv-xpub")

    async def _watch_subscriptions(self) -> None:
        assert self._subscribed is not None
        while True:
            try:
                msg = await self._pub.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if msg[:1] == b"\x01":
                async with self._subscribed:
                    self.subscriptions += 1
                    self._subscribed.notify_all()

    async def wait_subscribers(self, n: int = 1, timeout: float = 10.0) -> None:
        """Wait until ``n`` SUB sockets have subscribed in total (tests, and the slow-joiner
        problem: batches published before a SUB is attached never reach it)."""
        assert self._subscribed is not None, "start() first"

        async def _wait() -> None:
            async with self._subscribed:
                await self._subscribed.wait_for(lambda: self.subscriptions >= n)

        await asyncio.wait_for(_wait(), timeout)

    def lose_next(self, n: int = 1) -> None:
        """Fault injection for tests: buffer the next ``n`` batches for replay but do not send
        them on the PUB socket, as if the network had dropped them."""
        self._lose += n

    def publish(self, batch: KVEventBatch) -> int:
        """Encode and send ``batch``; returns its sequence number."""
        if batch.data_parallel_rank is None:
            batch = KVEventBatch(batch.ts, batch.events, self._rank)
        payload = encode_batch(batch, self._shape)
        return self.publish_raw(payload)

    def publish_raw(self, payload: bytes) -> int:
        """Send an already encoded payload (tests use it to inject garbage)."""
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._lose > 0:
            self._lose -= 1
            return seq
        try:
            # zmq.asyncio with NOBLOCK completes at once; PUB never blocks, it drops at the HWM.
            self._pub.send_multipart((self._topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # dropped like vLLM's PUB would; the subscriber resyncs through replay
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated):
                return
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                log.warning("ignoring malformed KV replay request with %d frames", len(frames))
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await sock.send_multipart((ident, b"", self._topic, encode_seq(seq), payload))
            await sock.send_multipart((ident, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        for task in (self._task, self._sub_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._task = self._sub_task = None
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        # destroy, not term: a socket still open (a replay cut short) would make term() wait for it
        # forever; closing twice is a no-op.
        self._ctx.destroy(linger=0)
