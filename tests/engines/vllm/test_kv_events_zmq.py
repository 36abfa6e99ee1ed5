"""KV events over real loopback ZMQ: initial replay, live stream, gap -> replay, failed resync."""

from __future__ import annotations

import asyncio

from engines.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from engines.vllm.kv_events_publisher import KVEventPublisher
from engines.vllm.kv_events_zmq import KVEventSubscriber


def stored(h: int) -> KVEventBatch:
    return KVEventBatch(ts=float(h), events=(BlockStored((h,), None, tuple(range(16)), 16),))


class Collector:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self._changed = asyncio.Event()

    def __call__(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)
        self._changed.set()

    async def wait_for(self, n: int, timeout: float = 10.0) -> None:
        async def _wait() -> None:
            while len(self.batches) < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(_wait(), timeout)


def hashes(batches: list[KVEventBatch]) -> list:
    out = []
    for b in batches:
        for ev in b.events:
            out.append("clear" if isinstance(ev, AllBlocksCleared) else ev.block_hashes[0])
    return out


def test_initial_replay_then_gap_resync():
    async def main() -> None:
        pub = KVEventPublisher(topic="kv")
        pub.start()
        pub.publish(stored(1))  # before anyone subscribed: only the replay buffer has these
        pub.publish(stored(2))
        got = Collector()
        sub = KVEventSubscriber(pub.endpoint_bound, got, replay_endpoint=pub.replay_endpoint_bound, topic="kv")
        sub.start()
        await pub.wait_subscribers(1)
        await asyncio.wait_for(sub.synced.wait(), 10)
        await got.wait_for(2)
        pub.publish(stored(3))
        pub.lose_next(2)
        pub.publish(stored(4))  # dropped on the wire
        pub.publish(stored(5))  # dropped on the wire
        pub.publish(KVEventBatch(6.0, (BlockRemoved((1,)),)))
        await got.wait_for(6)
        assert hashes(got.batches) == [1, 2, 3, 4, 5, 1]
        assert sub.stats.gaps == 1 and sub.stats.replays_ok == 2 and sub.stats.resets == 0
        assert sub.stats.last_seq == 5
        await sub.close()
        await pub.close()

    asyncio.run(main())


def test_joining_a_stream_under_way_without_replay_socket_is_not_a_gap():
    async def main() -> None:
        pub = KVEventPublisher(replay_endpoint=None)
        pub.start()
        for h in (1, 2, 3):  # published before anyone subscribed: gone for good (no replay socket)
            pub.publish(stored(h))
        got = Collector()
        sub = KVEventSubscriber(pub.endpoint_bound, got)
        sub.start()
        await pub.wait_subscribers(1)
        pub.publish(stored(4))
        pub.publish(stored(5))
        await got.wait_for(2)
        assert hashes(got.batches) == [4, 5]
        assert (sub.stats.gaps, sub.stats.resets, sub.stats.replays_failed, sub.stats.last_seq) == (0, 0, 0, 4)
        await sub.close()
        await pub.close()

    asyncio.run(main())


def test_the_initial_replay_waits_for_the_live_connection():
    """A batch published while the SUB side is still connecting reaches it through the initial
    replay, asked for once the connection is up: asked earlier, the batch would reach neither path,
    and with no later batch to show the gap it would stay missing. The live connection goes through
    a relay on loopback that holds it until the batch is out."""

    async def main() -> None:
        pub = KVEventPublisher(topic="kv")
        pub.start()
        host, port = pub.endpoint_bound.removeprefix("tcp://").rsplit(":", 1)
        accepted, release = asyncio.Event(), asyncio.Event()

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set()
            await release.wait()
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

        server = await asyncio.start_server(relay, "127.0.0.1", 0)
        got = Collector()
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}", got,
                                replay_endpoint=pub.replay_endpoint_bound, topic="kv", replay_timeout=30.0)
        sub.start()
        await accepted.wait()  # the subscriber is connecting; the relay holds it
        pub.lose_next(1)
        pub.publish(stored(1))  # not on the wire: only the replay buffer has it
        assert not sub.synced.is_set() and sub.stats.replays_ok == 0  # no replay before the connection
        release.set()
        await got.wait_for(1)
        assert hashes(got.batches) == [1] and sub.connections == 1
        assert (sub.stats.replays_ok, sub.stats.gaps, sub.stats.resets) == (1, 0, 0)
        await sub.close()
        server.close()
        await pub.close()

    asyncio.run(main())


def test_gap_without_replay_socket_clears_the_index():
    async def main() -> None:
        pub = KVEventPublisher(replay_endpoint=None)
        pub.start()
        got = Collector()
        sub = KVEventSubscriber(pub.endpoint_bound, got)
        sub.start()
        await pub.wait_subscribers(1)
        pub.publish(stored(1))
        await got.wait_for(1)
        pub.lose_next(1)
        pub.publish(stored(2))
        pub.publish(stored(3))
        await got.wait_for(3)
        # The lost batch cannot be fetched: the consumer is told to forget this instance first.
        assert hashes(got.batches) == [1, "clear", 3]
        assert sub.stats.gaps == 1 and sub.stats.resets == 1 and sub.stats.replays_failed == 1
        await sub.close()
        await pub.close()

    asyncio.run(main())


def test_malformed_payload_resets_and_keeps_going():
    async def main() -> None:
        pub = KVEventPublisher()
        pub.start()
        got = Collector()
        sub = KVEventSubscriber(pub.endpoint_bound, got, replay_endpoint=pub.replay_endpoint_bound)
        sub.start()
        await pub.wait_subscribers(1)
        await asyncio.wait_for(sub.synced.wait(), 10)
        pub.publish(stored(1))
        pub.publish_raw(b"\xc1 not msgpack")
        pub.publish(stored(2))
        await got.wait_for(3)
        assert hashes(got.batches) == [1, "clear", 2]
        assert sub.stats.decode_errors == 1
        await sub.close()
        await pub.close()

    asyncio.run(main())


def test_replay_buffer_evicted_means_reset():
    async def main() -> None:
        pub = KVEventPublisher(buffer_steps=1)
        pub.start()
        got = Collector()
        sub = KVEventSubscriber(pub.endpoint_bound, got, replay_endpoint=pub.replay_endpoint_bound)
        sub.start()
        await pub.wait_subscribers(1)
        await asyncio.wait_for(sub.synced.wait(), 10)
        pub.publish(stored(1))
        await got.wait_for(1)
        pub.lose_next(2)
        pub.publish(stored(2))
        pub.publish(stored(3))  # the buffer (1 batch) now holds only seq 2
        pub.publish(stored(4))
        await got.wait_for(3)
        assert hashes(got.batches) == [1, "clear", 4]
        await sub.close()
        await pub.close()

    asyncio.run(main())


def test_replay_accepts_the_older_three_frame_reply():
    """vLLM 0.32 replies [b"", topic, seq, payload] (4 frames at the DEALER, what KVEventPublisher
    sends); some earlier releases sent [b"", seq, payload]. A ROUTER speaking the older form."""
    import zmq
    import zmq.asyncio

    from engines.kv_event_encode import END_SEQ, encode_batch, encode_seq

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:0")

        async def serve() -> None:
            ident, _, start = await router.recv_multipart()
            assert int.from_bytes(start, "big") == 0
            for seq in (0, 1):
                await router.send_multipart((ident, b"", encode_seq(seq), encode_batch(stored(10 + seq))))
            await router.send_multipart((ident, b"", END_SEQ, b""))

        task = asyncio.get_running_loop().create_task(serve())
        got = Collector()
        sub = KVEventSubscriber(pub.getsockopt(zmq.LAST_ENDPOINT).decode(), got,
                                replay_endpoint=router.getsockopt(zmq.LAST_ENDPOINT).decode())
        sub.start()
        await asyncio.wait_for(sub.synced.wait(), 10)
        await task
        assert hashes(got.batches) == [10, 11] and sub.stats.replays_ok == 1
        await sub.close()
        pub.close(0)
        router.close(0)
        ctx.term()

    asyncio.run(main())
