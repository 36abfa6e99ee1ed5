"""A KV-event publisher restarted on the same ports (real loopback ZMQ): the subscriber detects it
(sequence backwards, socket reconnected), clears the instance and replays; failed replays are
retried with back-off."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

from engines.vllm.kv_events_publisher import KVEventPublisher
from engines.vllm.kv_events_zmq import KVEventSubscriber
from tests.engines.vllm.test_kv_events_zmq import Collector, hashes, stored


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@contextlib.asynccontextmanager
async def closed_at_end() -> AsyncIterator[Callable]:
    """``keep(x)`` returns ``x`` and closes it when the block ends, failed or not: a subscriber or
    publisher left open by a failed assertion would be torn down by the garbage collector in some
    later test, inside that test's event loop."""
    opened: list = []

    def keep(x):
        opened.append(x)
        return x

    try:
        yield keep
    finally:
        for x in reversed(opened):
            await x.close()


def publisher(ports: list[int]) -> KVEventPublisher:
    pub = KVEventPublisher(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}")
    pub.start()
    return pub


async def connected(keep: Callable, ports: list[int], **kw) -> tuple[KVEventPublisher, Collector, KVEventSubscriber]:
    """A publisher on ``ports`` and a subscriber to it (its replay socket too), synced."""
    pub = keep(publisher(ports))
    got = Collector()
    sub = keep(KVEventSubscriber(pub.endpoint_bound, got, replay_endpoint=pub.replay_endpoint_bound, **kw))
    sub.start()
    await pub.wait_subscribers(1)
    await asyncio.wait_for(sub.synced.wait(), 10)
    return pub, got, sub


def test_sequence_going_backwards_is_a_restart_cleared_and_replayed():
    async def main() -> None:
        async with closed_at_end() as keep:
            ports = free_ports(2)
            pub, got, sub = await connected(keep, ports, watch_reconnects=False)
            for h in (1, 2, 3):
                pub.publish(stored(h))
            await got.wait_for(3)
            await pub.close()
            pub = keep(publisher(ports))  # the engine is back on the same ports; its sequence starts at 0
            await pub.wait_subscribers(1)
            pub.publish(stored(10))
            pub.publish(stored(11))
            await got.wait_for(6)
            assert hashes(got.batches) == [1, 2, 3, "clear", 10, 11]
            assert sub.stats.restarts == 1 and sub.stats.last_seq == 1

    asyncio.run(main())


def test_reconnected_socket_is_a_restart_even_when_the_new_sequence_is_ahead():
    """The new publisher got further than the old one before the subscriber reconnected: its live
    sequence looks like a gap, not a step back; only the reconnection tells the restart."""

    async def main() -> None:
        async with closed_at_end() as keep:
            ports = free_ports(2)
            pub, got, sub = await connected(keep, ports)
            pub.publish(stored(1))
            pub.publish(stored(2))
            await got.wait_for(2)
            await pub.close()
            pub = keep(publisher(ports))
            for h in (10, 11, 12, 13):  # seq 0..3, before the subscriber is back: the replay buffer has them
                pub.publish(stored(h))
            await pub.wait_subscribers(1)
            pub.publish(stored(14))  # seq 4 > the old 1
            await got.wait_for(8)
            assert hashes(got.batches) == [1, 2, "clear", 10, 11, 12, 13, 14]
            assert sub.stats.restarts == 1

    asyncio.run(main())


def test_unreachable_replay_is_retried_then_counted_failed_once(caplog):
    async def main() -> None:
        async with closed_at_end() as keep:
            dead_replay = f"tcp://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
            pub = keep(KVEventPublisher(replay_endpoint=None))
            pub.start()
            got = Collector()
            sub = keep(KVEventSubscriber(pub.endpoint_bound, got, replay_endpoint=dead_replay, replay_timeout=0.1,
                                          replay_retries=2, retry_delay=0.05))
            calls = []
            real = sub._replay

            async def counted(start_seq):
                calls.append(start_seq)
                return await real(start_seq)

            sub._replay = counted
            sub.start()
            await asyncio.wait_for(sub.synced.wait(), 10)
            assert calls == [0, 0, 0] and sub.stats.replays_failed == 1 and sub.stats.replays_ok == 0

    with caplog.at_level("WARNING", logger="engines.vllm.kv_events_zmq"):
        asyncio.run(main())
    # each failed round trip says why: a timeout's own text is empty
    why = [r.getMessage() for r in caplog.records if "KV event replay from" in r.getMessage()]
    assert len(why) == 3 and all(m.endswith("failed: no reply within 0.1 s") for m in why), why


def test_a_replay_that_fails_once_succeeds_on_retry():
    async def main() -> None:
        async with closed_at_end() as keep:
            pub = keep(KVEventPublisher())
            pub.start()
            pub.publish(stored(1))
            got = Collector()
            sub = keep(KVEventSubscriber(pub.endpoint_bound, got, replay_endpoint=pub.replay_endpoint_bound,
                                          retry_delay=0.01))
            real = sub._replay
            failures = [None]

            async def flaky(start_seq):
                if failures:
                    return failures.pop()  # the publisher did not answer in time, once
                return await real(start_seq)

            sub._replay = flaky
            sub.start()
            await asyncio.wait_for(sub.synced.wait(), 10)
            await got.wait_for(1)
            assert hashes(got.batches) == [1]
            assert sub.stats.replays_ok == 1 and sub.stats.replays_failed == 0 and sub.stats.resets == 0

    asyncio.run(main())


def test_a_dropped_connection_clears_the_index_at_once_before_any_reconnect():
    """The publisher's engine dies: the consumer is told AllBlocksCleared when the connection drops,
    not when (if ever) the subscriber reconnects, and nothing else arrives until the resync."""

    async def main() -> None:
        async with closed_at_end() as keep:
            ports = free_ports(2)
            pub, got, sub = await connected(keep, ports)
            pub.publish(stored(1))
            await got.wait_for(1)
            await pub.close()  # no publisher comes back on these ports
            await got.wait_for(2)
            assert hashes(got.batches) == [1, "clear"]
            assert sub.stats.restarts == 0  # nothing reconnected yet
            pub = keep(publisher(ports))
            await pub.wait_subscribers(1)
            pub.publish(stored(5))
            await got.wait_for(3)
            assert hashes(got.batches) == [1, "clear", 5] and sub.stats.restarts == 1

    asyncio.run(main())
