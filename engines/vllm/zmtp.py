"""A ZMQ SUB socket's receiving side on the event loop's own TCP connection (ZMTP 3.0, NULL security).

Why not pyzmq's SUB socket: libzmq reads the TCP stream in its own I/O thread and hands each
message to the application thread through a mailbox (an eventfd). For the gateway that meant, per
KV event batch (one per new prompt), a wake-up of that thread and of the loop, libzmq's getpid and
poll syscalls behind every socket question, and pyzmq's objects per frame: per new 2k-token prompt
at c=1, 35 us of the I/O threads' CPU and 13 of the gateway's ~21 syscalls a request (strace -c).
Here the connection is an asyncio transport like every other socket of the gateway: one read per
burst, the frames cut out of the bytes read.

What it speaks, as RFC 23 (ZMTP 3.0) defines it and libzmq 4.x accepts from a SUB peer:

* the 64-byte greeting (signature ``FF 00..01 7F``, version 3.0, mechanism ``NULL``, as-server 0);
* the NULL handshake: our ``READY`` command with ``Socket-Type: SUB``; the peer's ``READY`` must
  name ``PUB`` or ``XPUB`` (an ``ERROR`` command, another mechanism or socket type ends the
  connection with the reason logged);
* a subscription as ZMTP 3.0 sends it: a one-frame message ``\\x01`` + topic (a 3.0 peer gets no
  3.1 ``SUBSCRIBE`` command from libzmq either, and libzmq's PUB filters on its side);
* then frames (flags: MORE 1, LONG 2, COMMAND 4; a 1- or 8-byte size), gathered into messages.
  Commands after the handshake are skipped (a 3.0 peer is sent no heartbeats).

Like libzmq with its defaults it connects again ``reconnect_interval`` seconds after a failed
connect or a lost connection, for as long as it is open; unlike libzmq's monitor, the owner learns
of a connection's end and of the next one's handshake in order with the data.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

from gpuhit.aio import cancel_and_wait
from gpuhit.errors import ConfigError, EngineError

log = logging.getLogger(__name__)

_SIGNATURE = b"\xff" + bytes(7) + b"\x01\x7f"
GREETING = _SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
_MORE, _LONG, _COMMAND = 1, 2, 4
# A frame announcing more than this is refused rather than buffered (libzmq's ZMQ_MAXMSGSIZE is
# unlimited by default; a 100k-token prompt's BlockStored batch is ~0.5 MB).
MAX_FRAME_BYTES = 1 << 30
HANDSHAKE_FRAME_BYTES = 1 << 16  # READY's properties: a socket type and perhaps an identity
_PEER_TYPES = (b"PUB", b"XPUB")


class ZmtpProtocolError(EngineError):
    """The peer does not speak what a SUB socket expects (caught inside: logged, counted, and the
    connection dropped)."""


def frame(body: bytes, flags: int = 0) -> bytes:
    """One ZMTP frame: flags, a 1-byte size (or LONG and 8 bytes), the body."""
    if len(body) > 255:
        return bytes((flags | _LONG,)) + len(body).to_bytes(8, "big") + body
    return bytes((flags, len(body))) + body


def ready_command(socket_type: bytes) -> bytes:
    """The NULL mechanism's READY command with its one property, ``Socket-Type``."""
    name = b"Socket-Type"
    body = b"\x05READY" + bytes((len(name),)) + name + len(socket_type).to_bytes(4, "big") + socket_type
    return frame(body, _COMMAND)


def command_properties(body: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    """A command's name and (for READY) its properties; ZmtpProtocolError when it does not parse."""
    if not body or len(body) < 1 + body[0]:
        raise ZmtpProtocolError(f"a command frame of {len(body)} bytes has no name")
    name, pos = body[1:1 + body[0]], 1 + body[0]
    props: dict[bytes, bytes] = {}
    if name != b"READY":
        return name, props
    while pos < len(body):
        klen = body[pos]
        key = body[pos + 1:pos + 1 + klen]
        pos += 1 + klen
        if pos + 4 > len(body):
            raise ZmtpProtocolError("READY's properties are cut short")
        vlen = int.from_bytes(body[pos:pos + 4], "big")
        props[key.lower()] = body[pos + 4:pos + 4 + vlen]
        pos += 4 + vlen
    if pos != len(body):
        raise ZmtpProtocolError("READY's properties are cut short")
    return name, props


def parse_endpoint(endpoint: str) -> tuple[str, int] | str:
    """``tcp://host:port`` -> (host, port); ``ipc://path`` -> path; ConfigError for anything else
    (``tcp://*:P`` is a bind address: a subscriber needs the publisher's host)."""
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return endpoint[6:]
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or parts.hostname == "*" or port is None:
        raise ConfigError(f"KV event endpoint {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    return parts.hostname, port


MessageCallback = Callable[[list[bytes]], None]


class _SubProtocol(asyncio.Protocol):
    """One connection: greeting, handshake, subscription, then messages to ``on_message``.

    A frame body cut by the reads is gathered as the reads' own slices and joined once, into a
    bytes object of the body's size: on this machine a second large transient allocation (the
    join of everything read, then the body sliced out of it) cost ~400 us for a 500 KB batch,
    the join alone 14."""

    def __init__(self, owner: ZmtpSubscriber):
        self._owner = owner
        self._transport: asyncio.Transport | None = None
        self._head = b""  # bytes read and not parsed yet: the handshake, or a frame header cut short
        self._body: list[bytes | memoryview] = []  # the pieces so far of a frame body cut short
        self._left = 0  # how many bytes that body still lacks
        self._flags = 0  # its frame's flags
        self._state = 0  # 0: the peer's greeting, 1: its READY, 2: live
        self._parts: list[bytes] = []  # the frames so far of a message with MORE set
        self.live = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport instances
        self._transport.write(GREETING + ready_command(b"SUB"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            if self._left:
                pos = self._fill(data)
                if pos < 0:
                    return
            else:
                pos = 0
                if self._head:
                    data = self._head + data  # a few bytes (a header), or the handshake's
                    self._head = b""
                if self._state != 2:
                    pos = self._handshake(data)
                    if pos < 0:
                        return
            self._messages(data, pos)
        except ZmtpProtocolError as exc:
            self._owner.protocol_error(str(exc))
            assert self._transport is not None
            self._transport.close()

    def _handshake(self, data: bytes) -> int:
        """Read the greeting and READY from ``data``; where the messages start, or -1 when the
        handshake is not all there yet (what is left of it kept for the next read)."""
        pos = 0
        if self._state == 0:
            if len(data) < len(GREETING):
                self._head = data
                return -1
            greeting = data[:len(GREETING)]
            if greeting[0] != 0xFF or greeting[9] != 0x7F:
                raise ZmtpProtocolError("the peer's greeting is not ZMTP's")
            if greeting[10] < 3:
                raise ZmtpProtocolError(f"the peer speaks ZMTP {greeting[10]}.x; 3.0 or later is needed")
            mechanism = greeting[12:32].rstrip(b"\x00")
            if mechanism != b"NULL":
                raise ZmtpProtocolError(f"the peer asks for the {mechanism.decode(errors='replace')} "
                                        f"security mechanism; only NULL is supported")
            self._state = 1
            pos = len(GREETING)
        got = _frame_at(data, pos)
        if got is None:
            self._head = data[pos:]
            return -1
        flags, body, end = got
        if not flags & _COMMAND:
            raise ZmtpProtocolError("the peer sent a message before its READY command")
        name, props = command_properties(body)
        if name == b"ERROR":
            reason = body[7:7 + body[6]] if len(body) > 6 else b""
            raise ZmtpProtocolError(f"the peer refused the handshake: {reason.decode(errors='replace')}")
        if name != b"READY":
            raise ZmtpProtocolError(f"the peer sent {name!r} where READY was due")
        kind = props.get(b"socket-type", b"")
        if kind not in _PEER_TYPES:
            raise ZmtpProtocolError(f"the peer is a {kind.decode(errors='replace') or 'socket of no type'}, "
                                    f"not a PUB or XPUB")
        self._state = 2
        assert self._transport is not None
        self._transport.write(frame(b"\x01" + self._owner.topic))
        self.live = True
        self._owner.handshake_done()
        return end

    def _messages(self, data: bytes, pos: int) -> None:
        """Deliver every whole message in ``data`` from ``pos``; a frame cut short is kept: its
        header in ``_head``, or its body's first piece in ``_body`` (see :meth:`_fill`). The frame
        header is read here as :func:`_frame_at` reads it, written out: this loop runs for every
        frame of every batch."""
        n = len(data)
        parts = self._parts
        deliver = self._owner.on_message
        while pos < n:
            flags = data[pos]
            if flags & _LONG:
                start = pos + 9
                if start > n:
                    self._head = data[pos:]
                    break
                size = int.from_bytes(data[pos + 1:start], "big")
                if size > MAX_FRAME_BYTES:
                    raise ZmtpProtocolError(f"the peer announced a frame of {size} bytes "
                                            f"(more than {MAX_FRAME_BYTES})")
                end = start + size
            else:
                start = pos + 2
                if start > n:
                    self._head = data[pos:]
                    break
                end = start + data[pos + 1]
            if end > n:  # the body goes on in the next reads
                self._body = [memoryview(data)[start:]]
                self._left = end - n
                self._flags = flags
                break
            pos = end
            if flags & _COMMAND:
                continue  # no command is due after the handshake (3.0: no heartbeats); skipped
            parts.append(data[start:end])
            if not flags & _MORE:
                self._parts = []
                deliver(parts)
                parts = self._parts
        self._parts = parts

    def _fill(self, data: bytes) -> int:
        """Add ``data`` to the body being gathered; once whole, handle its frame and answer where
        the rest of ``data`` starts (-1: the body still lacks bytes)."""
        left = self._left
        if len(data) < left:
            self._body.append(data)
            self._left = left - len(data)
            return -1
        self._body.append(memoryview(data)[:left] if left < len(data) else data)
        body = b"".join(self._body)
        self._body = []
        self._left = 0
        if not self._flags & _COMMAND:
            self._parts.append(body)
            if not self._flags & _MORE:
                parts, self._parts = self._parts, []
                self._owner.on_message(parts)
        return left


def _frame_at(data: bytes, pos: int, limit: int = HANDSHAKE_FRAME_BYTES) -> tuple[int, bytes, int] | None:
    """The whole frame at ``pos`` (flags, body, its end), or None when ``data`` ends first; a
    frame announcing more than ``limit`` bytes is a protocol error."""
    n = len(data)
    if n - pos < 2:
        return None
    flags = data[pos]
    if flags & _LONG:
        if n - pos < 9:
            return None
        start = pos + 9
        size = int.from_bytes(data[pos + 1:start], "big")
        if size > limit:
            raise ZmtpProtocolError(f"the peer announced a handshake frame of {size} bytes (more than {limit})")
        end = start + size
    else:
        start = pos + 2
        end = start + data[pos + 1]
    if end > n:
        return None
    return flags, data[start:end], end


class ZmtpSubscriber:
    """Subscribes to ``topic`` on the PUB socket at ``endpoint`` and hands each message (its frames
    as bytes) to ``on_message``, in order, from the event loop. ``on_connected`` runs when a
    connection's handshake is done, ``on_disconnected`` when a connection that got that far ends
    (everything it carried delivered first). Protocol errors are logged and counted in
    :attr:`protocol_errors`; like libzmq it then connects again."""

    def __init__(self, endpoint: str, topic: bytes, on_message: MessageCallback,
                 on_connected: Callable[[], None] | None = None,
                 on_disconnected: Callable[[], None] | None = None,
                 reconnect_interval: float = 0.1, name: str = ""):
        self.address = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self.topic = topic
        self.on_message = on_message
        self._on_connected = on_connected
        self._on_disconnected = on_disconnected
        self.reconnect_interval = reconnect_interval
        self.name = name or endpoint
        self.connections = 0  # handshakes completed
        self.protocol_errors = 0
        self._task: asyncio.Task | None = None
        self._transport: asyncio.BaseTransport | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"zmtp-sub-{self.name}")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def drop(self) -> None:
        """End the current connection as a network failure would (fault injection): the loss is
        reported as any other, and it connects again after the reconnect interval."""
        t = self._transport
        if t is not None:
            cast(asyncio.Transport, t).abort()

    def handshake_done(self) -> None:
        self.connections += 1
        if self._on_connected is not None:
            self._on_connected()

    def protocol_error(self, why: str) -> None:
        self.protocol_errors += 1
        log.warning("KV events from %s: %s; connecting again", self.endpoint, why)

    async def _connect(self) -> tuple[asyncio.BaseTransport, _SubProtocol]:
        loop = asyncio.get_running_loop()
        if isinstance(self.address, str):
            return await loop.create_unix_connection(lambda: _SubProtocol(self), self.address)
        host, port = self.address
        return await loop.create_connection(lambda: _SubProtocol(self), host, port)

    async def _run(self) -> None:
        while True:
            try:
                transport, proto = await self._connect()
            except OSError as exc:  # nobody listening yet (or any more): libzmq's retry, same interval
                log.debug("KV events from %s: connect failed (%s)", self.endpoint, exc)
            else:
                self._transport = transport
                try:
                    await proto.done
                finally:
                    transport.close()
                    self._transport = None
                if proto.live and self._on_disconnected is not None:
                    self._on_disconnected()
            await asyncio.sleep(self.reconnect_interval)  # the reconnect interval (loop time)
