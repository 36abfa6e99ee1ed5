"""The loop-side ZMQ SUB connection (engines.vllm.zmtp): against libzmq's own PUB/XPUB over TCP and
IPC (messages, topics, big frames, reconnection), and against a raw TCP peer that speaks bad ZMTP
or cuts frames at every byte."""

from __future__ import annotations

import asyncio
import os
import tempfile

import pytest
import zmq
import zmq.asyncio

from engines.vllm.zmtp import GREETING, ZmtpSubscriber, _SubProtocol, frame, parse_endpoint, ready_command
from gpuhit.errors import ConfigError
from tests.engines.vllm.test_kv_events_zmq import Collector


class Inbox(Collector):
    """Messages and connection events, in the order the subscriber reported them (``log``;
    :meth:`wait_for` is the collector's)."""

    @property
    def log(self) -> list:
        return self.batches

    def message(self, frames: list[bytes]) -> None:
        self(frames)  # type: ignore[arg-type]

    def connected(self) -> None:
        self("connected")  # type: ignore[arg-type]

    def disconnected(self) -> None:
        self("disconnected")  # type: ignore[arg-type]

    def subscriber(self, endpoint: str, topic: bytes = b"") -> ZmtpSubscriber:
        return ZmtpSubscriber(endpoint, topic, self.message, self.connected, self.disconnected)


async def subscribed(xpub: zmq.asyncio.Socket) -> bytes:
    """Wait for a subscription message on an XPUB socket (the SUB side is attached)."""
    return await asyncio.wait_for(xpub.recv(), 10)


def test_messages_from_libzmq_pub_in_order_with_topic_filter_and_big_frames():
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.bind("tcp://127.0.0.1:0")
        inbox = Inbox()
        sub = inbox.subscriber(pub.getsockopt(zmq.LAST_ENDPOINT).decode(), b"kv")
        sub.start()
        assert await subscribed(pub) == b"\x01kv"
        big = os.urandom(300_000)  # an 8-byte-size frame, read in several pieces
        await pub.send_multipart([b"other", b"dropped by the PUB's filter"])
        await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), b"x" * 255])
        await pub.send_multipart([b"kv", (1).to_bytes(8, "big"), big])
        await pub.send_multipart([b"kv", b"", b""])
        await inbox.wait_for(4)
        assert inbox.log == ["connected", [b"kv", (0).to_bytes(8, "big"), b"x" * 255],
                             [b"kv", (1).to_bytes(8, "big"), big], [b"kv", b"", b""]]
        assert sub.connections == 1 and sub.protocol_errors == 0
        await sub.close()
        pub.close(0)
        ctx.term()

    asyncio.run(main())


def test_ipc_endpoint_and_reconnect_after_the_publisher_goes():
    async def main() -> None:
        path = os.path.join(tempfile.mkdtemp(), "kv.sock")
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"ipc://{path}")
        inbox = Inbox()
        sub = inbox.subscriber(f"ipc://{path}")
        sub.start()
        await subscribed(pub)
        await pub.send_multipart([b"", b"one"])
        await inbox.wait_for(2)
        pub.close(0)
        await inbox.wait_for(3)  # the connection's end is reported after what it carried
        pub = ctx.socket(zmq.XPUB)
        pub.bind(f"ipc://{path}")
        await subscribed(pub)
        await pub.send_multipart([b"", b"two"])
        await inbox.wait_for(5)
        assert inbox.log == ["connected", [b"", b"one"], "disconnected", "connected", [b"", b"two"]]
        assert sub.connections == 2
        await sub.close()
        pub.close(0)
        ctx.term()

    asyncio.run(main())


class RawPeer:
    """A TCP server on 127.0.0.1 that answers a connection with ``script`` (bytes), written one
    byte at a time when ``trickle`` (every frame and the greeting cut at every possible place)."""

    def __init__(self, script: bytes, trickle: bool = False, close: bool = False):
        self.script = script
        self.trickle = trickle
        self.close = close
        self.received = bytearray()
        self.got_subscription = asyncio.Event()
        self.hung_up = asyncio.Event()  # the subscriber closed the connection

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunks = [self.script[i:i + 1] for i in range(len(self.script))] if self.trickle else [self.script]
        for c in chunks:
            writer.write(c)
            await writer.drain()
        if self.close:
            writer.close()
            return
        while data := await reader.read(65536):
            self.received += data
            if len(self.received) >= len(GREETING) + len(ready_command(b"SUB")) + 2:
                self.got_subscription.set()
        self.hung_up.set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


class Recorder:
    """A transport's write side, for feeding the protocol directly."""

    def __init__(self) -> None:
        self.sent = b""

    def write(self, data: bytes) -> None:
        self.sent += data

    def close(self) -> None:
        pass


def test_frames_cut_at_every_byte_and_commands_after_the_handshake_are_skipped():
    body = os.urandom(1000)  # an 8-byte-size frame
    script = (GREETING + ready_command(b"PUB")
              + frame(b"t", 1) + frame(b"a")  # [t, a]
              + frame(b"\x04PING\x00\x00", 4)  # a command: skipped
              + frame(b"t", 1) + frame(body, 1) + frame(b""))  # [t, body, ""]
    expected = ["connected", [b"t", b"a"], [b"t", body, b""]]

    async def feed(pieces: list[bytes]) -> tuple[list, bytes]:
        inbox = Inbox()
        proto = _SubProtocol(inbox.subscriber("tcp://127.0.0.1:1", b"t"))
        rec = Recorder()
        proto.connection_made(rec)  # type: ignore[arg-type]
        for p in pieces:
            proto.data_received(p)
        return inbox.log, rec.sent

    async def main() -> None:
        got, sent = await feed([script[i:i + 1] for i in range(len(script))])
        assert got == expected
        # What the subscriber said: greeting, READY as a SUB, then the subscription message.
        assert sent == GREETING + ready_command(b"SUB") + frame(b"\x01t")
        for cut in range(1, len(script)):
            got, _ = await feed([script[:cut], script[cut:]])
            assert got == expected, cut

    asyncio.run(main())


def test_trickled_over_tcp():
    async def main() -> None:
        script = GREETING + ready_command(b"PUB") + frame(b"", 1) + frame(os.urandom(300))
        peer = RawPeer(script, trickle=True)
        inbox = Inbox()
        sub = inbox.subscriber(await peer.start())
        sub.start()
        await inbox.wait_for(2)
        assert inbox.log == ["connected", [b"", script[-300:]]]
        await asyncio.wait_for(peer.got_subscription.wait(), 10)
        assert bytes(peer.received) == GREETING + ready_command(b"SUB") + frame(b"\x01")
        await sub.close()
        peer.server.close()

    asyncio.run(main())


@pytest.mark.parametrize("script, why", [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(40), "not ZMTP's"),
    (GREETING[:10] + b"\x02\x00" + GREETING[12:], "ZMTP 2.x"),
    (GREETING[:12] + b"CURVE".ljust(20, b"\x00") + GREETING[32:], "CURVE security mechanism"),
    (GREETING + ready_command(b"ROUTER"), "a ROUTER, not a PUB"),
    (GREETING + frame(b"\x05ERROR\x0bnot allowed", 4), "refused the handshake: not allowed"),
    (GREETING + frame(b"hello"), "a message before its READY"),
    (GREETING + frame(b"\x05READY\x0bSocket-Type\x00\x00", 4), "cut short"),
    (GREETING + b"\x06" + (1 << 20).to_bytes(8, "big"), "a handshake frame of 1048576 bytes"),
])
def test_a_peer_that_is_not_a_zmtp_publisher_is_refused_with_the_reason(script, why, caplog):
    async def main() -> None:
        peer = RawPeer(script + GREETING)  # more bytes after the fault are never read as messages
        inbox = Inbox()
        sub = inbox.subscriber(await peer.start())
        sub.reconnect_interval = 3600.0  # one connection is enough to see the refusal
        sub.start()
        await asyncio.wait_for(peer.hung_up.wait(), 10)  # the subscriber refused and hung up
        assert inbox.log == [] and sub.connections == 0 and sub.protocol_errors == 1
        await sub.close()
        peer.server.close()

    with caplog.at_level("WARNING"):
        asyncio.run(main())
    assert why in caplog.text


def test_a_frame_announced_bigger_than_the_limit_is_refused_not_buffered(caplog):
    async def main() -> None:
        peer = RawPeer(GREETING + ready_command(b"PUB") + frame(b"ok") + b"\x02" + (1 << 40).to_bytes(8, "big"))
        inbox = Inbox()
        sub = inbox.subscriber(await peer.start())
        sub.reconnect_interval = 3600.0
        sub.start()
        await asyncio.wait_for(peer.hung_up.wait(), 10)
        await inbox.wait_for(3)
        assert inbox.log == ["connected", [b"ok"], "disconnected"] and sub.protocol_errors == 1
        await sub.close()
        peer.server.close()

    with caplog.at_level("WARNING"):
        asyncio.run(main())
    assert "a frame of 1099511627776 bytes (more than 1073741824)" in caplog.text


def test_a_peer_that_closes_mid_frame_is_a_disconnection_and_nothing_half_read_is_delivered():
    async def main() -> None:
        peer = RawPeer(GREETING + ready_command(b"XPUB") + frame(b"whole") + frame(b"cut", 1), close=True)
        inbox = Inbox()
        sub = inbox.subscriber(await peer.start())
        sub.start()
        await inbox.wait_for(3)
        assert inbox.log[:3] == ["connected", [b"whole"], "disconnected"]
        await sub.close()
        peer.server.close()

    asyncio.run(main())


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://host", "udp://h:1", "ipc://", "tcp://h:port"])
def test_an_endpoint_a_subscriber_cannot_connect_to_is_a_config_error(endpoint):
    with pytest.raises(ConfigError, match="expected tcp://HOST:PORT or ipc://PATH"):
        parse_endpoint(endpoint)


def test_endpoints_parsed():
    assert parse_endpoint("tcp://127.0.0.1:5557") == ("127.0.0.1", 5557)
    assert parse_endpoint("tcp://[::1]:5557") == ("::1", 5557)
    assert parse_endpoint("ipc:///tmp/x") == "/tmp/x"
